"""Failed accepts are logged at most once per interval, as one line, with how many there were.

When the process runs out of file descriptors (a flood of connections, a descriptor
limit set low), every accept fails until connections close. asyncio reports each
failure to the loop's exception handler, with a traceback; at a few attempts per
second over minutes that is a log no one can read and a disk that fills. This handler
keeps the first line of each burst and a count of the rest, and passes every other
loop error to the handler that was there before.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
INTERVAL_S = 10.0


def is_accept_error(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    if str(context.get("message", "")).startswith("socket.accept()"):
        return True
    return isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS


class AcceptErrorLog:
    """A loop exception handler: accept errors rate-limited, everything else as before."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._previous = loop.get_exception_handler()
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not is_accept_error(context):
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return
        exc = context.get("exception")
        log.error(
            "cannot accept connections: %s",
            exc if exc is not None else context.get("message"),
            extra={"suppressed_since_last": self._suppressed, "interval_s": self.interval_s},
        )
        self._last = now
        self._suppressed = 0


def install(loop: asyncio.AbstractEventLoop) -> None:
    if not isinstance(loop.get_exception_handler(), AcceptErrorLog):
        loop.set_exception_handler(AcceptErrorLog(loop))
