"""A fair share of a saturated pool for every key: who gets the next free slot.

When every slot is taken, requests wait; today's order inside one key stays (lowest
priority value first, then first come). Across keys the next slot goes to the waiting
key that has been served the fewest *tokens* per unit of weight: start-time fair
queueing over tokens, the continuous form of deficit round robin. Tokens, not
requests: a key that sends long generations is charged for every token they produce,
so a key with short requests is not starved behind it, and two keys with equal
weights converge to equal token counts whatever their request sizes.

A key that has been idle does not bank credit: when it starts waiting again its count
is raised to the pool's current virtual time (the count of the key served last), so
it competes from now on, not from the start of the day.

The pool charges each request's prompt when it is admitted and each generated token as
it streams (:meth:`FairQueue.charge`); the queue itself only orders waiters.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Share:
    """Whose request it is, for the fair share: a key's name and weight."""

    key: str = ""
    weight: float = 1.0


ANY = Share()  # requests without a key: one share between them

Waiter = tuple[int, int, "asyncio.Future[None]"]


class FairQueue:
    """Waiting requests by key; :meth:`pop` gives the next one to admit."""

    def __init__(self) -> None:
        self._queues: dict[str, list[Waiter]] = {}
        self._served: dict[str, float] = {}  # tokens served / weight, by key
        self._virtual = 0.0  # the served count of the key admitted last
        self._order = itertools.count()

    def __len__(self) -> int:
        """Entries held, those already done (cancelled waiters) included until popped."""
        return sum(len(q) for q in self._queues.values())

    @property
    def waiting(self) -> int:
        """Waiters still waiting."""
        return sum(1 for q in self._queues.values() for _, _, f in q if not f.done())

    def push(self, share: Share, priority: int, future: asyncio.Future[None]) -> None:
        queue = self._queues.get(share.key)
        if queue is None:  # the key starts waiting: it competes from now, with no banked credit
            queue = self._queues[share.key] = []
            self._served[share.key] = max(self._served.get(share.key, 0.0), self._virtual)
        heapq.heappush(queue, (priority, next(self._order), future))

    def pop(self) -> asyncio.Future[None] | None:
        """The next waiter: from the key served least per weight, its lowest priority value first."""
        if not self._queues:
            return None
        key = min(self._queues, key=lambda k: (self._served[k], self._queues[k][0][1]))
        queue = self._queues[key]
        _, _, future = heapq.heappop(queue)
        if not queue:
            del self._queues[key]
        self._virtual = max(self._virtual, self._served[key])
        return future

    def charge(self, share: Share, tokens: int) -> None:
        """Count ``tokens`` of work done for ``share``'s key (a prompt admitted, a token generated)."""
        if tokens > 0:
            self._served[share.key] = self._served.get(share.key, self._virtual) + tokens / max(share.weight, 1e-6)

    def served(self, key: str) -> float:
        """Tokens served to ``key`` per unit of weight (its virtual time)."""
        return self._served.get(key, 0.0)
