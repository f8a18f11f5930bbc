"""Handing freed heap memory back to the system, now and then.

The engine's tensors come and go in sizes that glibc serves from its heap (a layer's keys
and values growing chunk by chunk, a chunk's activations and logits). What a request
frees stays mapped in holes between what others hold, so a burst of long prompts leaves the
process far larger than what it uses; ``malloc_trim`` gives most of it back (figures in
docs/benchmarks.md). It walks the whole heap, so the scheduler calls it after rounds that prefill or end a
request, at most once a second, never on every step, and once more a second after it goes idle
(the last answers are built and freed after their generations end). Elsewhere than glibc it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

INTERVAL_S = 1.0  # at most one trim per this many seconds


def _trim_function() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
        return trim
    except (OSError, AttributeError):  # not glibc
        return None


class HeapTrimmer:
    """``maybe()`` trims the heap unless it did less than :data:`INTERVAL_S` ago."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._trim = _trim_function()
        self._last = 0.0
        self.trims = 0
        # work has freed memory since the last trim: the engine trims once more when it goes idle,
        # a second later (a request's answer is built and freed after its generation has ended)
        self.pending = False

    def maybe(self) -> bool:
        """Trim now if it is time; True when it did."""
        self.pending = self._trim is not None
        now = time.monotonic()
        if self._trim is None or now - self._last < self.interval_s:
            return False
        self._trim(0)
        self._last = time.monotonic()
        self.trims += 1
        self.pending = False
        return True
