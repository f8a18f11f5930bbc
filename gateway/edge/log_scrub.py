"""Access tokens never reach the logs, whatever the log level.

prismgate itself logs no token, and writes no access log; but uvicorn and the
``websockets`` server log a WebSocket handshake's request line and headers at debug
level, which is where a browser's token travels (the ``access_token`` query parameter or
a ``bearer.<token>`` subprotocol). This filter, on those libraries' loggers, replaces the
token with ``***`` before any handler sees the record.
"""

from __future__ import annotations

import logging
import re

_SECRETS = (
    (re.compile(r"(access_token=)[^&\s'\"]+", re.IGNORECASE), r"\1***"),
    (re.compile(r"(bearer[ .])[^\s,'\"]+", re.IGNORECASE), r"\1***"),
)
LIBRARY_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "websockets", "websockets.server")


def scrub(text: str) -> str:
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class ScrubTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


_FILTER = ScrubTokens()


def install() -> None:
    """Put the filter on the loggers that can see handshakes (adding it twice is a no-op)."""
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).addFilter(_FILTER)
