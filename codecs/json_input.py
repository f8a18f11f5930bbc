"""JSON from a client, parsed only once it is known to be parseable within the budget.

Every codec that reads JSON (OpenAI bodies, Evergreen JSON frames, the GraphPipe
``config``) goes through here, so that the same input gets the same refusal on every
wire: nesting over the budget's ``max_json_depth`` is refused before the parser recurses
into it, and what Python's parser rejects with something other than a decode error (an
integer of more than 4300 digits is a ValueError, 100k brackets a RecursionError) is an
INVALID_ARGUMENT naming the problem, never an internal error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from prismgate.core.budget import RequestBudget, too_many_digits
from prismgate.core.errors import invalid

T = TypeVar("T")
OFF_LOOP_BYTES = 64 * 1024  # larger inputs are scanned and parsed in a worker thread


def checked(raw: bytes | str, budget: RequestBudget, what: str, parse: Callable[[Any], T]) -> T:
    """``parse(raw)`` after the depth check; its ValueError/RecursionError become INVALID_ARGUMENT."""
    budget.check_json(raw, what)
    try:
        return parse(raw)
    except RecursionError:
        raise invalid(f"{what} nests JSON too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        reason = too_many_digits(exc) or str(exc)
        raise invalid(f"{what} is not valid JSON: {reason}") from None


def loads(raw: bytes | str, budget: RequestBudget, what: str) -> Any:
    return checked(raw, budget, what, json.loads)


async def loads_off_loop(raw: bytes | str, budget: RequestBudget, what: str) -> Any:
    """:func:`loads`, in a worker thread when the input is large (scanning and parsing cost time in proportion)."""
    return await off_loop(len(raw), loads, raw, budget, what)


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)``, in a worker thread when ``size`` (the input's bytes) is large, else right here.

    A thread costs more than decoding a small input; a large one decoded on the event loop
    holds every other connection (``/healthz`` included) for as long as it takes.
    """
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)
