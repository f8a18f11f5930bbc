"""A generation's output, pulled from the core as fast as the engine makes it, for a client that may not read.

Why a buffer of its own: a codec that pulls the next event only once the client has taken
the last one ties the engine, and the admission slot, to the client's reading. A client
that stops reading then holds a slot for as long as it likes, and when the generation has
ended its last events still wait for it. :class:`Outflow` pulls the wire messages in a
task of its own, so the generation ends (and frees its slot) as soon as the engine is done,
as long as what the client has not read fits in ``limit_bytes``
(``slow_client_buffer_bytes``); past that the pump waits, the engine pauses, and it is
the transport's deadline (``slow_client_timeout_s``, :func:`reader_deadline`) that ends a
client that still does not read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

from prismgate.core.errors import Code, GatewayError

T = TypeVar("T")


class SlowReader(GatewayError):
    """The client has not read for ``slow_client_timeout_s``: its stream is dropped."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            Code.RESOURCE_EXHAUSTED,
            f"the client read nothing for {timeout_s:g}s (slow_client_timeout_s); the stream was dropped",
        )


class Outflow(Generic[T]):
    """Iterate the messages of ``source``; closing the outflow (``async with``) closes the source."""

    def __init__(self, source: AsyncIterator[T], size: Callable[[T], int], limit_bytes: int) -> None:
        self._source = source
        self._size = size
        self._limit = limit_bytes
        self._items: collections.deque[tuple[T, int]] = collections.deque()
        self._buffered = 0
        self._ready = asyncio.Event()
        self._woken = False
        self._room = asyncio.Event()
        self._room.set()
        self._error: BaseException | None = None
        self._ended = False
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Outflow[T]:
        self._pump = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop pulling and close the source (the core undoes or ends the generation)."""
        pump, self._pump = self._pump, None
        if pump is not None:
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump

    async def _run(self) -> None:
        try:
            async for item in self._source:
                size = self._size(item)
                self._items.append((item, size))
                self._buffered += size
                self._ready.set()
                if self._buffered >= self._limit:
                    self._room.clear()
                    await self._room.wait()
        except Exception as exc:  # the source's error reaches the client after what came before it
            self._error = exc
        finally:
            self._ended = True
            self._ready.set()
            aclose = getattr(self._source, "aclose", None)
            if aclose is not None:
                await aclose()

    async def take(self) -> tuple[list[T], bool]:
        """Every message buffered now (waiting for one if there are none), and whether the source has ended.

        One wake-up hands a writer everything that came since its last write, so it can put
        them on the wire in one go. The list is empty only after :meth:`wake` (or at the end).
        """
        if not self._items and not self._ended and not self._woken:
            self._ready.clear()
            await self._ready.wait()
        self._woken = False
        items = [item for item, _ in self._items]
        self._items.clear()
        self._buffered = 0
        self._room.set()
        if not items and self._ended and self._error is not None:  # what came before an error goes out first
            error, self._error = self._error, None
            raise error
        return items, self._ended and self._error is None

    def wake(self) -> None:
        """Make a waiting (or the next) :meth:`take` return now, empty-handed if nothing came (a writer's timer)."""
        self._woken = True
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        while not self._items:
            if self._ended:
                error, self._error = self._error, None
                if error is not None:
                    raise error
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        item, size = self._items.popleft()
        self._buffered -= size
        if self._buffered < self._limit:
            self._room.set()
        return item


@contextlib.asynccontextmanager
async def reader_deadline(timeout_s: float) -> AsyncIterator[None]:
    """One write to the client must be taken within ``timeout_s``; else :class:`SlowReader`."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise SlowReader(timeout_s) from None
