"""Pacing: how much prompt each round prefills, so that those waiting on the round wait about a target time.

A round of the worker thread runs prefill chunks, then the decode steps; a decoding stream waits
for every chunk of the round. While others wait (decoding streams, queued requests, other prompts
prefilling), the round's prefill is sized to last about ``target_s``: the requests with prompt
left take turns (the one that stepped least recently first), each taking a chunk that fits what
is left of the round's time, until the time is spent; at least one chunk runs each round, of at
least ``floor`` tokens, and none leaves a remainder shorter than that (a short prompt is not
split over two rounds). Alone, a request's chunks grow to last up to :data:`ALONE` targets (at
most ``ceiling`` tokens), not more: a step under way cannot be cut short, and a newcomer waits
for it.

The time a chunk takes is measured, not guessed: seconds per prompt token, a moving average per
context size (attention makes deeper positions dearer) and per kind (a prompt whose positions
are scored or read out costs more per token). A cost not yet measured gets the smallest chunk,
which measures it; but a prompt alone that fits in one chunk takes it whole, so the first short
prompt after a start runs in the one chunk that later ones of its size run in (the same bits).
Chunk sizes are multiples of ``align``, so the shapes the model sees stay few.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Alone, a step may last this many targets: a newcomer that arrives during it waits for at most
# this, then a round of one target. The price is paid by a long prompt alone, which prefills about
# a tenth slower than in full chunks (docs/benchmarks.md, "Waiting behind a long prompt").
ALONE = 2.5


@dataclass(frozen=True)
class Prefill:
    """A request with prompt tokens still to run."""

    key: int  # the request's identity across rounds
    context: int  # positions already in its cache
    left: int  # prompt tokens still to run
    outputs: bool  # its prompt's positions are scored, read out or encoded


class Pace:
    def __init__(
        self,
        *,
        ceiling: int,
        target_s: float,
        floor: int = 32,
        align: int = 32,
        weight: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.ceiling = ceiling
        self.target_s = target_s  # 0: no bound, every prefilling request takes a full chunk each round
        self.floor = min(floor, ceiling)
        self.align = align
        self.weight = weight  # of the newest measurement in the moving average
        self.clock = clock  # what the scheduler times chunks with
        self._rates: dict[tuple[bool, int], float] = {}  # (outputs, context bucket) -> seconds per token
        self._served: dict[int, int] = {}  # request key -> the round it last prefilled in
        self._round = 0

    @staticmethod
    def bucket(context: int) -> int:
        """Contexts of about the same cost per token: one per 256 positions. Attention makes a
        token's cost grow with the context before it, so a chunk costed at the rate of a bucket
        too shallow overruns its time, and a newcomer waits for that."""
        return context // 256

    def rate(self, context: int, outputs: bool) -> float | None:
        """Seconds per prompt token at ``context``: its bucket's, else the nearest measured one's (below first)."""
        here = self.bucket(context)
        measured = sorted(b for kind, b in self._rates if kind == outputs)
        if not measured:
            return None
        below = [b for b in measured if b <= here]
        return self._rates[outputs, below[-1] if below else measured[0]]

    def record(self, context: int, tokens: int, outputs: bool, seconds: float) -> None:
        """A chunk of ``tokens`` prompt tokens from ``context`` on took ``seconds``."""
        if tokens <= 0 or seconds < 0:
            return
        key = (outputs, self.bucket(context))
        sample = seconds / tokens
        old = self._rates.get(key)
        self._rates[key] = sample if old is None else old + self.weight * (sample - old)

    def plan(self, prefills: Sequence[Prefill], others_wait: bool) -> dict[int, int]:
        """This round's chunk size for each request that prefills in it (by key); those left out wait a round.

        ``prefills`` come in the scheduler's order (priority, then arrival), which breaks ties
        between requests that last stepped in the same round."""
        self._round += 1
        self._served = {p.key: self._served[p.key] for p in prefills if p.key in self._served}
        if self.target_s <= 0:
            for p in prefills:
                self._served[p.key] = self._round
            return {p.key: self.ceiling for p in prefills}
        chosen: dict[int, int] = {}
        contended = others_wait or len(prefills) > 1
        budget = self.target_s if contended else self.target_s * ALONE
        for p in sorted(prefills, key=lambda p: self._served.get(p.key, -1)):
            rate = self.rate(p.context, p.outputs)
            if rate is None:  # unmeasured: a chunk that measures it, and nothing else this round
                if not chosen:
                    chosen[p.key] = self.floor if contended or p.left > self.ceiling else self.ceiling
                    self._served[p.key] = self._round
                break
            size = self.fit(budget / rate) if rate > 0 else self.ceiling
            if size < p.left <= min(size + self.floor, self.ceiling):
                size = p.left  # what would be left is shorter than the floor: not a round of its own
            cost = min(size, p.left) * rate
            if chosen and cost > budget:
                break  # not even the smallest chunk fits what is left of the round
            chosen[p.key] = size
            self._served[p.key] = self._round
            budget -= cost
            if budget <= 0:
                break
        return chosen

    def fit(self, tokens: float) -> int:
        """A chunk of about ``tokens``: a multiple of ``align``, within [floor, ceiling]."""
        size = int(tokens) // self.align * self.align
        return max(self.floor, min(self.ceiling, size))
