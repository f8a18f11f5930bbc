"""The messages a session sends, in order, with backpressure on generation.

Why a queue of its own: aborts and closing fragments must always get through, so
putting never blocks; but a generation waits in :meth:`Outbox.wait_for_room` while the
transport has ``limit_bytes`` unsent (``slow_client_buffer_bytes``), so a client that
stops reading pauses the engine instead of filling memory, and a generation whose rest
fits ends (and frees its engine slot) without waiting for the client.
"""

from __future__ import annotations

import asyncio

from prismgate.schemas import evergreen_pb2 as pb


class Outbox:
    """Messages for the transport, in order; ``None`` marks the end."""

    def __init__(self, limit_bytes: int = 1024 * 1024) -> None:
        self.limit_bytes = limit_bytes
        self._queue: asyncio.Queue[tuple[pb.SessionMessage | None, int]] = asyncio.Queue()
        self._bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def put_nowait(self, message: pb.SessionMessage | None) -> None:
        size = 0 if message is None else message.ByteSize()
        self._queue.put_nowait((message, size))
        self._bytes += size
        if self._bytes >= self.limit_bytes:
            self._room.clear()

    async def get(self) -> pb.SessionMessage | None:
        message, size = await self._queue.get()
        self._bytes -= size
        if self._bytes < self.limit_bytes:
            self._room.set()
        return message

    async def wait_for_room(self) -> None:
        await self._room.wait()
