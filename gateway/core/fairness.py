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

The pool charges each generated token as it streams, and the prompt tokens the engine
ran (its cache reused the rest) when the request ends, beyond the first
:data:`FREE_PROMPT_TOKENS` of each request, at :data:`PROMPT_TOKEN_COST` each
(:func:`prompt_cost`). The share is what clients compare, generated tokens, so a chat-sized
prompt costs nothing: charged in full at 1/8, a key of short answers to 35-token chat prompts
got 0.64 of the tokens of a key of long ones (bench/fair_share.py), paying for prompts the
engine runs in one pass with most of its share. A long prompt is still charged, at 1/8 of a
generated token per token (it runs ``prefill_chunk`` tokens per forward pass, a generated token
one), so a key cannot take the engine with long prompts and one-token answers for free.

Without preemption a waiting key's request starts only when a slot frees, and a pool full
of one key's long generations frees slots rarely. ``reserve`` slots of the pool are
therefore kept for *newcomers*, keys with nothing running and nothing queued: one may take
a free reserved slot at once, ahead of the queue, and a reserved slot that frees goes only
to a newcomer. The cost is those slots idle while a single key fills the pool; 0 (the
default) reserves none.
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

    def push(self, share: Share, priority: int, future: asyncio.Future[None]) -> None:
        queue = self._queues.get(share.key)
        if queue is None:  # the key starts waiting: it competes from now, with no banked credit
            queue = self._queues[share.key] = []
            self._served[share.key] = max(self._served.get(share.key, 0.0), self._virtual)
        heapq.heappush(queue, (priority, next(self._order), future))

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

    def served(self, key: str) -> float:
        """Tokens served to ``key`` per unit of weight (its virtual time)."""
        return self._served.get(key, 0.0)
