"""The messages a session sends, in order, with backpressure on generation.

Why a queue of its own: aborts and closing fragments must always get through, so
putting never blocks; but a generation waits in :meth:`Outbox.wait_for_room` while the
transport has ``limit`` messages unsent, so a client that stops reading pauses the
engine instead of filling memory.
"""

from __future__ import annotations

import asyncio

from prismgate.schemas import evergreen_pb2 as pb


class Outbox:
    """Messages for the transport, in order; ``None`` marks the end."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._queue: asyncio.Queue[pb.SessionMessage | None] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()

    def put_nowait(self, message: pb.SessionMessage | None) -> None:
        self._queue.put_nowait(message)
        if self._queue.qsize() >= self.limit:
            self._room.clear()

    async def get(self) -> pb.SessionMessage | None:
        message = await self._queue.get()
        if self._queue.qsize() < self.limit:
            self._room.set()
        return message

    async def wait_for_room(self) -> None:
        await self._room.wait()
