"""Memory is a budget too: what a request may make the server hold, known before it runs.

``max_active`` counts requests, not bytes, so every request's worst case is estimated from its
spec before admission (:func:`request_bytes`: its keys and values, the reports it will make,
its logits row) and the pool admits requests while their estimates fit ``memory_budget_bytes``
(:class:`MemoryBudget`); one that alone exceeds it is refused. The rules (first fit, answers held
until written) are docs/architecture.md, "The memory budget".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineInfo
from prismgate.core.errors import Code, GatewayError, exhausted
from prismgate.core.fairness import FairQueue

# Per-entry sizes: what CPython and the codecs make of one entry at the peak, not the wire's bytes
# (docs/benchmarks.md, "Figures behind the code's constants").
LOGPROB_ENTRY_BYTES = 400  # one (id, logprob) of a position's list, with its text, as event, objects and JSON
FEATURE_ENTRY_BYTES = 400  # one SAE feature of a token (id, activation, label), counted as a logprob entry
READOUT_VALUE_BYTES = 104  # one float of a readout: float32 in the event, a Python float, its JSON text and bytes
LOGITS_VALUE_BYTES = 4  # the float32 vocabulary row an engine keeps to sample a request's next token
REQUEST_BYTES = 64 << 10  # a request's own bookkeeping (its events' objects, its stream's state)
AUTO_FRACTION = 100  # the default budget: this fraction of the machine's memory ...
AUTO_MIN = 64 << 20  # ... at least this ...
AUTO_MAX = 256 << 20  # ... at most this (the server's growth over idle stays near it, whatever the machine),
FULL_CONTEXTS = 1  # ... but room for this many requests at the largest served model's whole context


def covered(ranges: Sequence[PositionRange], horizon: int) -> int:
    """How many positions in ``[0, horizon)`` the ranges cover (overlaps counted once)."""
    spans = sorted((max(r.start, 0), min(r.end, horizon)) for r in ranges if min(r.end, horizon) > max(r.start, 0))
    total, reach = 0, 0
    for start, end in spans:
        start = max(start, reach)
        if end > start:
            total += end - start
            reach = end
    return total


def request_bytes(spec: GenerateSpec, prompt_tokens: int, info: EngineInfo) -> int:
    """The worst case a request holds while it runs, from its spec and the model alone."""
    horizon = prompt_tokens + spec.max_tokens
    logprob_positions = covered(spec.logprob_ranges, horizon)
    readout_positions = covered(spec.readout_ranges, horizon) if info.readouts is not None else 0
    values_per_readout = len(info.readouts.layers) * len(info.readouts.concepts) if info.readouts else 0
    return (
        REQUEST_BYTES
        + kv_bytes(horizon, info)
        + info.vocab_size * LOGITS_VALUE_BYTES
        + logprob_positions * (spec.logprob_top_k + 1) * LOGPROB_ENTRY_BYTES
        + readout_positions * values_per_readout * READOUT_VALUE_BYTES
        + feature_entries(spec, horizon, info) * FEATURE_ENTRY_BYTES
    )


def kv_bytes(horizon: int, info: EngineInfo) -> int:
    """The keys and values of ``horizon`` positions, in whole blocks: the part of a request's estimate
    that its engine frees when it drops a paused request's cache (:meth:`Reservation.lend`)."""
    block = max(1, info.kv_block_tokens)
    return -(-horizon // block) * block * info.kv_bytes_per_token


def feature_entries(spec: GenerateSpec, horizon: int, info: EngineInfo) -> int:
    """SAE feature entries a request reports: per covered position and layer, its top k and watched ids."""
    features = spec.features
    if features is None or info.features is None:
        return 0
    layers = len(features.layers) or len(info.features.layers)
    return covered(features.ranges, horizon) * layers * (features.top_k + len(features.ids))


def machine_bytes() -> int:
    """Physical memory (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def machine_share(fraction: int, low: int, high: int) -> int:
    """``1/fraction`` of the machine's memory, at least ``low`` and at most ``high`` bytes."""
    return min(max(machine_bytes() // fraction, low), high)


def default_budget(infos: Iterable[EngineInfo] = ()) -> int:
    """The budget when the setting is 0: a fraction of the machine's memory, within bounds, and at least
    :data:`FULL_CONTEXTS` plain requests at the whole context of the largest of the served models (``infos``):
    a prompt the model can take is never refused for its keys and values alone."""
    whole = max((request_bytes(GenerateSpec(max_tokens=0), i.max_model_len, i) for i in infos), default=0)
    return max(machine_share(AUTO_FRACTION, AUTO_MIN, AUTO_MAX), FULL_CONTEXTS * whole)


class Reservation:
    """The bytes one request holds in a :class:`MemoryBudget`: its whole estimate, less what it has lent.

    A request preempted with its keys and values dropped lends their bytes to the request that took
    its place (:meth:`lend`), and claims them back before it goes on (:meth:`regain`).
    """

    def __init__(self, budget: MemoryBudget, size: int, key: str = "", order: int = 0) -> None:
        self.budget = budget
        self.held = size
        self.key, self.order = key, order  # whose it is and its place in line, for the waiters' order
        self._claim: asyncio.Future[None] | None = None  # a regain not granted yet

    def lend(self, size: int) -> None:
        """Give ``size`` of the held bytes back to the budget now, granting nobody: for a ``make_room``
        callback of :meth:`MemoryBudget.reserve`, whose caller takes them first."""
        if not 0 < size <= self.held or self._claim is not None:
            raise ValueError(f"cannot lend {size} bytes of a reservation holding {self.held}")
        self.held -= size
        self.budget.used -= size

    def regain(self, size: int, then: Callable[[], None]) -> None:
        """Claim ``size`` bytes back, behind the request they were lent to: as a waiter, granted when bytes
        are next freed; ``then()`` runs once they are held."""
        future = self.budget.claim(size, self, wait=True, key=self.key, order=self.order)
        self._claim = future
        future.add_done_callback(lambda f: self._regained(f, then))

    def _regained(self, future: asyncio.Future[None], then: Callable[[], None]) -> None:
        self._claim = None
        if not future.cancelled():
            then()

    def close(self) -> None:
        """The request has ended: a claim still waiting is withdrawn, and every held byte goes back."""
        if self._claim is not None and not self._claim.done():
            self._claim.cancel()
        self._claim = None
        held, self.held = self.held, 0
        hold = _ANSWER.get()
        if held and (hold is None or not hold.keep(self.budget, held)):
            self.budget._free(held)


@dataclass(eq=False)
class _Claim:
    """A request waiting for bytes: whose it is (``key``), its place in line, and where granted bytes count."""

    size: int
    future: asyncio.Future[None]
    reservation: Reservation | None
    key: str
    order: int


class MemoryBudget:
    """Requests hold their estimate while they run; together at most ``limit`` bytes, the rest wait.

    Waiters are granted first fit, the waiter of the key served least per weight first (``fair``, the
    pool's fair queue, which a key enters when it starts waiting for bytes), then by their place in
    line; without ``fair``, oldest first.
    """

    def __init__(self, limit: int, *, max_waiting: int = 1024, fair: FairQueue | None = None) -> None:
        self.auto = limit <= 0
        self.limit = limit if limit > 0 else default_budget()
        self.max_waiting = max_waiting
        self.fair = fair
        self.used = 0
        self._waiters: list[_Claim] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for claim in self._waiters if not claim.future.done())

    def fit(self, infos: Iterable[EngineInfo]) -> None:
        """Size a default budget (the setting 0) to the served models, once they have loaded."""
        if self.auto:
            self.limit = default_budget(infos)
            self._grant()

    @contextlib.asynccontextmanager
    async def reserve(
        self,
        size: int,
        make_room: Callable[[int], None] | None = None,
        *,
        key: str = "",
        order: int | None = None,
    ) -> AsyncIterator[Reservation]:
        """Hold ``size`` bytes of the budget for the body; RESOURCE_EXHAUSTED when ``size`` alone is over it.

        ``key`` and ``order``: whose request it is and its place in line, for the waiters' order. When the
        bytes do not fit, ``make_room(short)`` may first free at least ``short`` of them
        (:meth:`Reservation.lend`): this request then takes them ahead of the waiters. Inside
        :func:`hold_answer`, the bytes stay held after the body until that answer is written.
        """
        order = next(self._arrivals) if order is None else order
        if size > self.limit:
            raise exhausted(
                f"this request may hold about {size >> 20} MiB (the keys and values of its prompt and max_tokens, "
                f"its logprob and readout positions), more than the server's memory budget of {self.limit >> 20} MiB "
                "(memory_budget_bytes); send a shorter prompt or max_tokens, report fewer positions or fewer top "
                "logprobs"
            )
        if self.used + size > self.limit and make_room is not None:
            make_room(self.used + size - self.limit)
        reservation = Reservation(self, size, key, order)
        if self.used + size > self.limit:
            if self.waiting >= self.max_waiting:
                self._grant()  # what make_room freed goes to the waiters
                raise GatewayError(
                    Code.UNAVAILABLE,
                    f"server overloaded: {self.waiting} requests wait for memory (memory_budget_bytes "
                    f"{self.limit >> 20} MiB held by running requests); retry later",
                )
            future = self.claim(size, key=key, order=order)
            try:
                await future
            except BaseException:
                if future.done() and not future.cancelled():
                    self._free(size)  # granted, but leaving
                else:
                    future.cancel()
                    self._grant()  # a smaller request behind this one may fit now
                raise
        else:
            self.used += size
        try:
            yield reservation
        finally:
            reservation.close()

    def claim(
        self,
        size: int,
        reservation: Reservation | None = None,
        *,
        wait: bool = False,
        key: str = "",
        order: int = 0,
    ) -> asyncio.Future[None]:
        """A future that resolves once ``size`` bytes are held for the caller (at once when they fit, unless
        ``wait``); granted bytes count in ``reservation.held`` when one is given."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        claim = _Claim(size, future, reservation, key, order)
        if not wait and self.used + size <= self.limit:
            self._take(claim)
            return future
        if self.fair is not None and not any(c.key == key and not c.future.done() for c in self._waiters):
            self.fair.enter(key)
        self._waiters.append(claim)
        return future

    def _take(self, claim: _Claim) -> None:
        self.used += claim.size
        if claim.reservation is not None:
            claim.reservation.held += claim.size
        claim.future.set_result(None)

    def _free(self, size: int) -> None:
        self.used -= size
        self._grant()

    def _grant(self) -> None:
        """Admit every waiter that fits now, in the waiters' order (first fit)."""
        waiting = [claim for claim in self._waiters if not claim.future.done()]
        fair = self.fair
        waiting.sort(key=lambda c: (fair.served(c.key) if fair is not None else 0.0, c.order))
        self._waiters = []
        for claim in waiting:
            if self.used + claim.size <= self.limit:
                self._take(claim)
            else:
                self._waiters.append(claim)


class AnswerHold:
    """Budget bytes whose generations have ended but whose answer is still being built or written."""

    def __init__(self) -> None:
        self._held: list[tuple[MemoryBudget, int]] = []
        self._open = True

    def keep(self, budget: MemoryBudget, size: int) -> bool:
        """Keep ``size`` bytes of ``budget`` until :meth:`release`; False once released (free them now)."""
        if self._open:
            self._held.append((budget, size))
        return self._open

    def release(self) -> None:
        """The answer is written (or abandoned): its bytes go back to their budgets. Idempotent."""
        self._open = False
        held, self._held = self._held, []
        for budget, size in held:
            budget._free(size)


_ANSWER: contextvars.ContextVar[AnswerHold | None] = contextvars.ContextVar("prismgate_answer_hold", default=None)


def hold_answer() -> AnswerHold:
    """From now on in this context (and tasks started from it), generations that end keep their budget
    bytes until the returned hold is released: a codec that builds a whole answer after the generation's
    end (OpenAI's non-streamed JSON) calls this before it starts one and releases once the answer is written."""
    hold = AnswerHold()
    _ANSWER.set(hold)
    return hold
