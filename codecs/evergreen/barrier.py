""" "Every earlier GENERATE has read its inputs": the barrier a DROP waits behind.

Why a structure of its own: thousands of actions in one frame (DROPs queued behind a
GENERATE whose input never arrives) must not each wait on every earlier action, which
costs time and memory quadratic in the frame. Here an action waits on one future, and
each step costs O(log n).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class ReadBarrier:
    def __init__(self) -> None:
        self._unread: set[int] = set()
        self._order: list[int] = []  # unread action indices, a heap (read ones leave lazily)
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._tie = itertools.count()

    def opened(self, index: int) -> None:
        """Action ``index`` will read inputs; later waiters wait for it."""
        self._unread.add(index)
        heapq.heappush(self._order, index)

    def read(self, index: int) -> None:
        """Action ``index`` has read its inputs (or ended without): release whoever it held back."""
        self._unread.discard(index)
        oldest = self._oldest()
        while self._waiters and (oldest is None or self._waiters[0][0] < oldest):
            future = heapq.heappop(self._waiters)[2]
            if not future.done():
                future.set_result(None)

    async def wait(self, index: int) -> None:
        """Until every action before ``index`` has read its inputs."""
        oldest = self._oldest()
        if oldest is None or oldest > index:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (index, next(self._tie), future))
        await future

    def _oldest(self) -> int | None:
        while self._order and self._order[0] not in self._unread:
            heapq.heappop(self._order)
        return self._order[0] if self._order else None
