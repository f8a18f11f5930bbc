"""The thread bridge: events from the worker thread to the consumer on its event loop.

The worker must never wait for a consumer, and the event loop must never wait for the
model. The worker hands each event to the consumer's loop (``call_soon_threadsafe``) and
counts what it sent; the consumer counts what it took. The difference is the backlog: the
scheduler pauses a request whose consumer has left :data:`MAX_BACKLOG` events unread, so
a slow reader holds back only its own request and memory stays bounded.
"""

from __future__ import annotations

import asyncio

from prismgate.core.events import Event

MAX_BACKLOG = 64  # events a slow consumer may leave unread before its request is paused


class EventChannel:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.produced = 0  # written by the worker thread
        self.consumed = 0  # written by the consumer's loop
        self.closed = False  # the consumer is gone: the worker stops working for it

    @property
    def backlog(self) -> int:
        return self.produced - self.consumed

    @property
    def paused(self) -> bool:
        return self.backlog >= MAX_BACKLOG

    def send(self, item: Event | BaseException) -> None:
        """Worker thread: queue an event (or the error that ends the stream) for the consumer."""
        self.produced += 1
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone
            self.closed = True

    async def receive(self) -> Event:
        """Consumer's loop: the next event; an error the worker sent is raised here."""
        item = await self.queue.get()
        self.consumed += 1
        if isinstance(item, BaseException):
            raise item
        return item
