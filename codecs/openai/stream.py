"""Server-Sent Events for a client that may stop reading.

The events come out of an :class:`~prismgate.codecs.outflow.Outflow`, so the generation
ends (and frees its engine slot) without waiting for the client as long as what it has
not read fits the buffer, and every write has the slow-reader deadline. A client that
misses it loses the stream: the generation is stopped, and the last thing it reads, if it
ever reads again, is an error event naming ``slow_client_timeout_s``. The connection then
waits for the client to read or leave, holding only what was already written.

Why a writer of our own (and not ``sse-starlette``, nor a timeout around each write): a
stream writes once per token, so whatever a write costs is paid per token. Here a write is
one ``send`` of every event that came since the last one, and one timer per stream watches
both the slow-reader deadline and the keep-alive ping, re-armed only when it fires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

from starlette.types import Receive, Scope, Send

from prismgate.codecs.openai.errors import to_openai
from prismgate.codecs.outflow import Outflow, SlowReader
from prismgate.settings import Settings

log = logging.getLogger(__name__)

PING_S = 15  # a comment line after this long without a write keeps proxies from closing the stream
HEADERS = [
    (b"cache-control", b"no-store"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),  # nginx: pass each event on at once
    (b"content-type", b"text/event-stream; charset=utf-8"),
]


class EventStream:
    """An ASGI response: ``events`` (each one ``data:`` payload) as SSE, with the slow-reader rules."""

    def __init__(self, events: AsyncIterator[str], settings: Settings, dumps: Callable[[Any], str]) -> None:
        self.events = events
        self.timeout_s = settings.streams.timeout_s
        self.limit_bytes = settings.streams.buffer_bytes
        self.dumps = dumps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
        async with Outflow(self.events, len, self.limit_bytes) as outflow:
            writer = _Writer(outflow, send, self.timeout_s)
            stream = asyncio.create_task(writer.run())
            gone = asyncio.create_task(_disconnected(receive))
            try:
                await asyncio.wait((stream, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (stream, gone):
                    task.cancel()
                await asyncio.gather(stream, gone, return_exceptions=True)
            if not writer.timed_out:
                if not stream.cancelled():
                    stream.result()  # the source's own error, if it raised one
                return
        # the generation is stopped (the outflow is closed) before the client is told why
        exc = SlowReader(self.timeout_s)
        log.info("openai stream dropped: %s", exc.message)
        last = f"data: {self.dumps(to_openai(exc).body())}\n\n".encode()
        await send({"type": "http.response.body", "body": last, "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Writer:
    """Writes what the outflow holds, one ``send`` per wake-up; one timer per stream for the deadline and pings."""

    def __init__(self, outflow: Outflow[str], send: Send, timeout_s: float) -> None:
        self.outflow = outflow
        self.send = send
        self.timeout_s = timeout_s
        self.timed_out = False
        self._loop = asyncio.get_running_loop()
        self._writing_since: float | None = None  # loop time the write in flight began
        self._last_write = self._loop.time()
        self._ping = False
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        self._task = asyncio.current_task()
        self._arm(self._loop.time() + min(self.timeout_s, PING_S))
        try:
            ended = False
            while not ended:
                events, ended = await self.outflow.take()
                if events:
                    body = "".join([f"data: {event}\n\n" for event in events]).encode()
                elif self._ping:
                    body = f": ping - {datetime.now(UTC)}\n\n".encode()
                else:
                    body = b""
                self._ping = False
                if body or ended:
                    await self._write(body, more_body=not ended)
        finally:
            if self._timer is not None:
                self._timer.cancel()

    async def _write(self, body: bytes, *, more_body: bool) -> None:
        self._writing_since = self._loop.time()
        try:
            await self.send({"type": "http.response.body", "body": body, "more_body": more_body})
        finally:
            self._last_write = self._writing_since
            self._writing_since = None

    def _arm(self, when: float) -> None:
        self._timer = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        """The timer: end a write blocked past the deadline, or ask for a ping after ``PING_S`` of silence."""
        now = self._loop.time()
        since = self._writing_since
        if since is not None:
            if now - since >= self.timeout_s:
                self.timed_out = True
                self._timer = None
                if self._task is not None:
                    self._task.cancel()
                return
            self._arm(since + self.timeout_s)
            return
        if now - self._last_write >= PING_S:
            self._ping = True
            self.outflow.wake()
            self._last_write = now  # the next ping is PING_S after this one, whenever the writer gets to it
        self._arm(min(now + self.timeout_s, self._last_write + PING_S))
