"""Framed messages between our own processes over a Unix socket.

A frame is a 4-byte big-endian length and a pickled *list* of messages: everything a
process has to say in one event-loop tick goes out in one frame and one ``write``, so a
host streaming 256 generations sends one frame per engine step, not one per token.
Pickle is acceptable here because both ends are this program, over a socket in a 0700
directory that only this user can reach.

Errors cross as data (:func:`pack_error`, :func:`unpack_error`): a
:class:`~prismgate.core.errors.GatewayError` keeps its code, message and retry hint; any
other exception becomes INTERNAL with its text.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

from prismgate.core.errors import Code, GatewayError

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30

Message = tuple[Any, ...]


def pack_error(exc: BaseException) -> tuple[int, str, float | None]:
    if isinstance(exc, GatewayError):
        return int(exc.code), exc.message, exc.retry_after_s
    return int(Code.INTERNAL), f"engine host: {type(exc).__name__}: {exc}", None


def unpack_error(packed: tuple[int, str, float | None]) -> GatewayError:
    code, message, retry_after_s = packed
    error = GatewayError(Code(code), message)
    error.retry_after_s = retry_after_s
    return error


class Channel:
    """One end of a connection: :meth:`send` queues, the loop's next tick writes them all."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._pending: list[Message] = []
        self._scheduled = False
        self.closed = False

    def send(self, message: Message) -> None:
        if self.closed:
            return
        self._pending.append(message)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self.closed or not self._pending:
            return
        batch, self._pending = self._pending, []
        body = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.writer.write(HEADER.pack(len(body)) + body)
        except (ConnectionError, RuntimeError):
            self.closed = True

    async def drain(self) -> None:
        """Let the transport's buffer empty (back-pressure on a slow reader)."""
        if not self.closed:
            await self.writer.drain()

    async def receive(self) -> list[Message]:
        """The next frame's messages; ``asyncio.IncompleteReadError`` when the other end has gone."""
        header = await self.reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        if size > MAX_FRAME:
            raise ConnectionError(f"frame of {size} bytes")
        batch: list[Message] = pickle.loads(await self.reader.readexactly(size))
        return batch

    def close(self) -> None:
        self._flush()
        self.closed = True
        self.writer.close()
