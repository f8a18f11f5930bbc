"""Server-Sent Events for a client that may stop reading.

The events come out of an :class:`~prismgate.codecs.outflow.Outflow`, so the generation
ends (and frees its engine slot) without waiting for the client as long as what it has
not read fits the buffer, and every write has the slow-reader deadline. A client that
misses it loses the stream: the generation is stopped, and the last thing it reads, if it
ever reads again, is an error event naming ``slow_client_timeout_s``. The connection then
waits for the client to read or leave, holding only what was already written.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.types import Message, Receive, Scope, Send

from prismgate.codecs.openai.errors import to_openai
from prismgate.codecs.outflow import Outflow, SlowReader, reader_deadline
from prismgate.settings import Settings

log = logging.getLogger(__name__)

PING_S = 15


class EventStream:
    """An ASGI response: ``events`` (each one ``data:`` payload) as SSE, with the slow-reader rules."""

    def __init__(self, events: AsyncIterator[str], settings: Settings, dumps: Callable[[Any], str]) -> None:
        self.events = events
        self.timeout_s = settings.slow_client_timeout_s
        self.limit_bytes = settings.slow_client_buffer_bytes
        self.dumps = dumps

    async def _buffered(self) -> AsyncIterator[str]:
        async with Outflow(self.events, len, self.limit_bytes) as events:
            async for event in events:
                yield event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            async with reader_deadline(self.timeout_s):
                await send(message)

        response = EventSourceResponse(self._buffered(), sep="\n", ping=PING_S)
        try:
            await response(scope, receive, timed_send)
        except SlowReader as exc:
            log.info("openai stream dropped: %s", exc.message)
            last = f"data: {self.dumps(to_openai(exc).body())}\n\n".encode()
            await send({"type": "http.response.body", "body": last, "more_body": False})
