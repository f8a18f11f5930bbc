"""Driving an engine directly with one request, as the engine tests do."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from prismgate.core.actions import Fork, GenerateSpec
from prismgate.core.engine import EngineRequest
from prismgate.core.events import Done, TokenEvent


def chat(engine: Any, *messages: str) -> tuple[int, ...]:
    """The chat template's tokens of alternating user and assistant ``messages``."""
    roles = ["user", "assistant"]
    return tuple(
        engine.info.tokenizer.render_chat([{"role": roles[i % 2], "content": m} for i, m in enumerate(messages)])
    )


async def run(
    engine: Any, tokens: tuple[int, ...], session: str | None = None, fork: Fork | None = None, **spec: Any
) -> tuple[list[TokenEvent], Done]:
    """Generate with ``GenerateSpec(**spec)``; the events before Done, and Done."""
    request = EngineRequest(
        request_id=uuid.uuid4().hex, tokens=tokens, spec=GenerateSpec(**spec), session_key=session, fork=fork
    )
    events: list[TokenEvent] = []
    async for ev in engine.generate(request):
        if isinstance(ev, Done):
            return events, ev
        events.append(ev)
    raise AssertionError("the engine stream ended without Done")


async def until(condition: Callable[[], bool], within: float = 60.0) -> None:
    """Wait until ``condition()`` holds (another thread makes it so), checked every 10 ms."""
    async with asyncio.timeout(within):
        for _ in iter(condition, True):
            await asyncio.sleep(0.01)
