"""A fair share of a saturated pool for every key: who gets the next free slot.

Across keys the next slot goes to the waiting key served the fewest *tokens* per unit of weight
(start-time fair queueing over tokens), so a key of long generations cannot starve a key of short
ones; within a key, lowest priority value first, then first come. An idle key banks no credit.
Generated tokens are charged as they stream, prompt tokens the engine ran beyond
:data:`FREE_PROMPT_TOKENS` at :data:`PROMPT_TOKEN_COST` each (:func:`prompt_cost`), so a
chat-sized prompt is free and long prompts are not. ``reserve`` slots are kept for keys with
nothing running or queued. Where the engine can pause a request, a key with nothing running
(or far below its share) takes a slot at once from the key holding the most slots per weight (preemption,
:class:`~prismgate.core.pool.Admission`). docs/keys.md, "A fair share", says why each rule and
what it measured.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from dataclasses import dataclass

PROMPT_TOKEN_COST = 1 / 8  # a prefilled prompt token beyond the free ones, in generated tokens
FREE_PROMPT_TOKENS = 256  # prompt tokens of each request that cost nothing


def prompt_cost(prefilled_tokens: int) -> int:
    """What ``prefilled_tokens`` prompt tokens the engine ran for one request cost, in generated
    tokens (rounded up): nothing for the first :data:`FREE_PROMPT_TOKENS`."""
    return math.ceil(max(prefilled_tokens - FREE_PROMPT_TOKENS, 0) * PROMPT_TOKEN_COST)


@dataclass(frozen=True, slots=True)
class Share:
    """Whose request it is, for the fair share: a key's name and weight."""

    key: str = ""
    weight: float = 1.0


ANY = Share()  # requests without a key: one share between them

Waiter = tuple[int, int, "asyncio.Future[None]"]


class FairQueue:
    """Waiting requests by key; :meth:`pop` gives the next one to admit."""

    def __init__(self, reserve: int = 0) -> None:
        self.reserve = reserve
        self._running: dict[str, int] = {}  # slots held, by key
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

    def arrival(self) -> int:
        """The next place in line (first come, first served within a priority)."""
        return next(self._order)

    def push(self, share: Share, priority: int, future: asyncio.Future[None], order: int | None = None) -> None:
        """Queue ``future`` for a slot; ``order``: its place in line, when it already has one (a preempted request)."""
        queue = self._queues.get(share.key)
        if queue is None:  # the key starts waiting
            self.enter(share.key)
            queue = self._queues[share.key] = []
        heapq.heappush(queue, (priority, self.arrival() if order is None else order, future))

    def may_start(self, share: Share, active: int, max_active: int) -> bool:
        """Whether a request of ``share`` may take a slot now, without queueing (``active`` slots held)."""
        if active >= max_active:
            return False
        if self.reserve and not self._running.get(share.key) and share.key not in self._queues:
            return True  # a newcomer: any free slot, the reserved ones included
        return not len(self) and active < max_active - self.reserve

    def pop(self, newcomers_only: bool = False) -> asyncio.Future[None] | None:
        """The next waiter still waiting, now holding a slot: from the key served least per weight, its lowest
        priority value first. ``newcomers_only``: the slot is a reserved one, for a key with nothing running."""
        while True:
            keys = [k for k in self._queues if not (newcomers_only and self._running.get(k))]
            if not keys:
                return None
            key = min(keys, key=lambda k: (self._served[k], self._queues[k][0][1]))
            queue = self._queues[key]
            _, _, future = heapq.heappop(queue)
            if not queue:
                del self._queues[key]
            if not future.done():  # a cancelled waiter is dropped
                self._virtual = max(self._virtual, self._served[key])
                self.started(Share(key))
                return future

    def started(self, share: Share) -> None:
        """A request of ``share`` holds a slot."""
        self._running[share.key] = self._running.get(share.key, 0) + 1

    def running(self, key: str) -> int:
        """Slots held by ``key``."""
        return self._running.get(key, 0)

    def finished(self, share: Share) -> None:
        """A request of ``share`` gave its slot back."""
        left = self._running.get(share.key, 0) - 1
        if left > 0:
            self._running[share.key] = left
        else:
            self._running.pop(share.key, None)

    def charge(self, share: Share, tokens: int) -> None:
        """Count ``tokens`` of work done for ``share``'s key (a prompt admitted, a token generated)."""
        if tokens > 0:
            self._served[share.key] = self._served.get(share.key, self._virtual) + tokens / max(share.weight, 1e-6)

    def enter(self, key: str) -> None:
        """``key`` starts waiting (for a slot, or for memory before that): it competes from now, with no
        banked credit, from the served count of the key admitted last when its own is lower."""
        if key not in self._queues:
            self._served[key] = max(self._served.get(key, 0.0), self._virtual)

    def served(self, key: str) -> float:
        """Tokens served to ``key`` per unit of weight (its virtual time)."""
        return self._served.get(key, 0.0)
