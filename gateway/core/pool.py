"""The process-wide engine pool: one place for admission control and priorities.

Every codec submits through the same pool, so limits hold across protocols: a
flood of GraphPipe rows cannot starve Salience sessions beyond their priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from prismgate.core import health
from prismgate.core.engine import Engine, EngineRequest, Holdable
from prismgate.core.errors import Code, GatewayError, quote
from prismgate.core.events import Done, Event, TokenEvent
from prismgate.core.fairness import ANY, FairQueue, Share, prompt_cost
from prismgate.core.health import Health
from prismgate.core.memory import MemoryBudget, Reservation, kv_bytes, request_bytes


def _weight(share: Share) -> float:
    return max(share.weight, 1e-6)


@dataclass(eq=False)
class Ticket:
    """One request's claim on a slot: whose it is, its place in line, and how to pause its work.

    ``hold`` is set by whoever runs the request when its engine can pause it
    (:class:`~prismgate.core.engine.Holdable`); without it the request is never preempted.
    ``resumed`` is set while it is preempted: it resolves when a slot is back.
    ``memory`` and ``droppable`` are set with ``hold``: the request's budget bytes, and how many of
    them its engine frees when it drops the request's keys and values (preempted for memory).
    """

    share: Share
    priority: int
    order: int
    hold: Callable[..., bool] | None = None  # hold(held, drop=False): pause or let go; whether it is in flight
    resumed: asyncio.Future[None] | None = None
    memory: Reservation | None = None
    droppable: int = 0
    granted: bool = False  # a slot was passed to it by a preemption before it asked


class Admission:
    """At most ``max_active`` requests run; the rest wait: the next free slot goes to the key
    with the least tokens served per weight, and within a key to the lowest priority value
    (:mod:`prismgate.core.fairness`; ``reserved`` of the slots are kept for keys with nothing running).

    Preemption: when every slot is taken and a request comes from a key with nothing paused and
    nothing running (or far below its share: :meth:`_preempt`), the running request of the key
    holding the most slots per weight (its least urgent, then latest) is paused by its engine,
    its KV cache kept, and its slot passes to the newcomer.
    The paused request queues again in its old place in line and goes on when a slot comes back;
    its memory stays reserved throughout. When the newcomer's memory is what is short, the paused
    request's keys and values are dropped instead and their bytes pass on too
    (:meth:`preempt_for_memory`): it queues again once they are back, and its engine recomputes them.
    The core decides whom; the engine only holds, drops and lets go.
    """

    def __init__(self, max_active: int, max_queued: int, reserved: int = 0, preemption: bool = True) -> None:
        if max_active < 1:
            raise ValueError("max_active must be >= 1")
        if not 0 <= reserved < max_active:
            raise ValueError("reserved slots must be >= 0 and fewer than max_active")
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self.fair = FairQueue(reserved)
        self.preemption = preemption
        self.preemptions = 0  # requests paused so far
        self.recomputes = 0  # of them, those whose keys and values were dropped (memory was short)
        self._holders: set[Ticket] = set()  # running or paused
        self._paused: dict[str, int] = {}  # paused requests, by key

    @property
    def queued(self) -> int:
        return self.fair.waiting

    def ticket(self, priority: int, share: Share = ANY) -> Ticket:
        """A request's claim before it asks for a slot (:meth:`slot`): its place in line for memory until then."""
        return Ticket(share, priority, self.fair.arrival())

    @contextlib.asynccontextmanager
    async def slot(self, priority: int, share: Share = ANY, ticket: Ticket | None = None) -> AsyncIterator[Ticket]:
        if ticket is None:
            ticket = self.ticket(priority, share)
        elif not ticket.granted:
            ticket.order = self.fair.arrival()  # its place in line for a slot: from when it asks for one
        if ticket.granted:
            pass  # a preemption passed it a slot already (preempt_for_memory)
        elif self.fair.may_start(share, self.active, self.max_active):
            self.active += 1
            self.fair.started(share)
        elif not self._preempt(ticket):
            if self.queued >= self.max_queued:
                raise GatewayError(
                    Code.UNAVAILABLE,
                    f"server overloaded: {self.active} requests running and "
                    f"{self.queued} waiting (limit {self.max_queued}); retry later",
                )
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.fair.push(share, priority, future, ticket.order)
            try:
                await future
            except BaseException:
                if future.done() and not future.cancelled():
                    self._release(share)  # we were granted the slot but are leaving
                raise
        self._holders.add(ticket)
        try:
            yield ticket
        finally:
            self._holders.discard(ticket)
            resumed = ticket.resumed
            self._unpause(ticket)
            if resumed is None or (resumed.done() and not resumed.cancelled()):
                self._release(share)  # it holds a slot (a paused one that leaves holds none)
            else:
                resumed.cancel()

    def _preempt(self, newcomer: Ticket) -> bool:
        """Pause a running request for ``newcomer``, its keys and values kept, and pass its slot on;
        whether one was paused."""
        victim = self._pause_for(newcomer, self._candidates(newcomer), drop=False)
        if victim is None:
            return False
        assert victim.resumed is not None
        self.fair.push(victim.share, victim.priority, victim.resumed, victim.order)
        return True

    def preempt_for_memory(self, newcomer: Ticket, short: int) -> Ticket | None:
        """Pause a running request for ``newcomer``, whose memory is ``short`` bytes short, with its keys
        and values dropped (at least ``short`` bytes of them): the paused one, or None. The newcomer
        holds its slot from now on (``granted``); the caller passes the bytes on and queues the paused
        one again (:meth:`requeue`) once they are back."""
        candidates = [
            t for t in self._candidates(newcomer) if t.memory is not None and t.memory.held >= t.droppable >= short
        ]
        victim = self._pause_for(newcomer, candidates, drop=True)
        if victim is not None:
            newcomer.granted = True
        return victim

    def requeue(self, ticket: Ticket) -> None:
        """A request paused with its keys and values dropped has its bytes back: it starts again at once
        if a slot is free to it, else it waits in its old place in line."""
        resumed = ticket.resumed
        if resumed is None or resumed.done():
            return
        if self.fair.may_start(ticket.share, self.active, self.max_active):
            self.active += 1
            self.fair.started(ticket.share)
            resumed.set_result(None)
        else:
            self.fair.push(ticket.share, ticket.priority, resumed, ticket.order)

    def rank(self, share: Share) -> float:
        """A request of ``share`` that holds a slot, among those beginning with it: the slots its key holds
        beside it, per unit of weight (:attr:`~prismgate.core.engine.EngineRequest.rank`), so that a
        key far below its share begins first, as it would have been admitted first."""
        return max(self.fair.running(share.key) - 1, 0) / _weight(share)

    def _candidates(self, newcomer: Ticket) -> list[Ticket]:
        """The running requests that may be paused for ``newcomer``, the first to pause first.

        ``newcomer``'s key must have nothing paused, and either nothing running or so few slots
        that it still holds no more per weight than the paused request's key after the swap (far
        below its share): so two keys never take a slot back and forth.
        """
        key = newcomer.share.key
        if not self.preemption or self._paused.get(key):
            return []
        after = (self.fair.running(key) + 1) / _weight(newcomer.share)

        def may_pause(t: Ticket) -> bool:
            if t.hold is None or t.resumed is not None or t.priority < newcomer.priority:  # never one more urgent
                return False
            return not self.fair.running(key) or (self.fair.running(t.share.key) - 1) / _weight(t.share) >= after

        return sorted(
            (t for t in self._holders if may_pause(t)),
            key=lambda t: (self.fair.running(t.share.key) / _weight(t.share), t.priority, t.order),
            reverse=True,
        )

    def _pause_for(self, newcomer: Ticket, candidates: list[Ticket], *, drop: bool) -> Ticket | None:
        """Pause the first of ``candidates`` its engine holds and pass its slot to ``newcomer``."""
        victim = next((t for t in candidates if t.hold is not None and t.hold(True, drop=drop)), None)
        if victim is None:  # none is in flight in its engine any more
            return None
        self.preemptions += 1
        self.recomputes += drop
        self._paused[victim.share.key] = self._paused.get(victim.share.key, 0) + 1
        victim.resumed = asyncio.get_running_loop().create_future()
        victim.resumed.add_done_callback(lambda _: self._resume(victim))
        self.fair.finished(victim.share)
        self.fair.started(newcomer.share)
        return victim

    def _resume(self, ticket: Ticket) -> None:
        """A paused request got a slot back: its engine lets it go on."""
        resumed = ticket.resumed
        if resumed is None or resumed.cancelled():
            return
        self._unpause(ticket)
        if ticket.hold is not None:
            ticket.hold(False)

    def _unpause(self, ticket: Ticket) -> None:
        if ticket.resumed is None:
            return
        ticket.resumed = None
        left = self._paused.get(ticket.share.key, 0) - 1
        if left > 0:
            self._paused[ticket.share.key] = left
        else:
            self._paused.pop(ticket.share.key, None)

    def _release(self, share: Share) -> None:
        self.fair.finished(share)
        future = self.fair.pop(newcomers_only=self.active > self.max_active - self.fair.reserve)
        if future is not None:
            future.set_result(None)  # the slot passes straight to the waiter
        else:
            self.active -= 1


# A session whose timeline is at least this long waits for its busy replica rather than
# moving to an idle one: prefilling that much again costs more than a wait for decode steps.
AFFINITY_MIN_TOKENS = 256


@runtime_checkable
class RankedEngine(Protocol):
    """An engine that runs several copies of its model itself (vLLM's data parallelism).

    ``ranks()`` returns one :class:`~prismgate.core.engine.Engine` per copy, each running its
    requests on that copy and reporting that copy's load: the pool chooses between them with
    the same rule as between separate engines (:class:`Replicas`).
    """

    def ranks(self) -> list[Engine]: ...


def copies_of(engine: Engine) -> list[Engine]:
    """The replicas an engine stands for: its ranks when it runs several copies itself, else itself."""
    return list(engine.ranks()) if isinstance(engine, RankedEngine) else [engine]


class Replicas:
    """One model's engines (copies of it) and which copy holds each session's KV cache.

    The rule (docs/scaling.md): a session's turn goes to the replica that served its
    last turn, where its cache is; it moves only when that replica is busy, another is
    idle, and the session is shorter than :data:`AFFINITY_MIN_TOKENS`. New sessions and
    one-off requests go to the least loaded replica: fewest requests in flight, then
    fewest sessions cached.
    """

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self._home: dict[str, int] = {}  # session key -> index of the replica holding its cache
        self._homed = [0] * len(engines)

    def pick(self, request: EngineRequest) -> Engine:
        if len(self.engines) == 1:
            return self.engines[0]
        key = request.session_key
        home = self._home.get(key) if key is not None else None
        loads = [engine.in_flight() for engine in self.engines]
        if home is not None and (loads[home] == 0 or 0 not in loads or len(request.tokens) >= AFFINITY_MIN_TOKENS):
            return self.engines[home]
        index = min(range(len(self.engines)), key=lambda i: (loads[i], self._homed[i], i))
        if key is not None:
            self.release(key)  # its cache on the old replica is of no use any more
            self._home[key] = index
            self._homed[index] += 1
        return self.engines[index]

    def home(self, session_key: str) -> int | None:
        """The index of the replica holding the session's cache (None: not placed yet)."""
        return self._home.get(session_key)

    def release(self, session_key: str) -> None:
        home = self._home.pop(session_key, None)
        if home is not None:
            self._homed[home] -= 1
        for engine in self.engines:
            engine.release(session_key)


class EnginePool:
    """Engines by model id, shared by every codec in the process.

    Engines with the same model id are replicas of that model (see :class:`Replicas`), and
    so are the ranks of an engine that runs data-parallel copies itself (:class:`RankedEngine`).
    """

    def __init__(
        self,
        engines: list[Engine],
        *,
        max_active: int = 64,
        max_queued: int = 1024,
        reserved_slots: int = 0,
        preemption: bool = True,
        memory_budget_bytes: int = 0,
    ) -> None:
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        grouped: dict[str, list[Engine]] = {}
        for engine in engines:
            grouped.setdefault(engine.model_id, []).extend(copies_of(engine))
        self._models = {model: Replicas(copies) for model, copies in grouped.items()}
        self._all = list(engines)
        self.default_model = engines[0].model_id
        self.admission = Admission(max_active, max_queued, reserved_slots, preemption)
        # 0: sized to the machine; waiters for bytes go in the fair share's order, as for slots
        self.memory = MemoryBudget(memory_budget_bytes, max_waiting=max_queued, fair=self.admission.fair)
        self._stopping = False

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def replicas(self, model: str | None = None) -> Replicas:
        name = model or self.default_model
        replicas = self._models.get(name)
        if replicas is None:
            served = ", ".join(sorted(self._models))
            raise GatewayError(Code.NOT_FOUND, f"model {quote(name)} is not served here; this server serves {served}")
        return replicas

    def engine(self, model: str | None = None) -> Engine:
        """The model's first replica: what every copy shares (info, image sizing)."""
        return self.replicas(model).engines[0]

    def health(self) -> Health:
        """READY only when every engine is; otherwise the state that keeps the pool from serving."""
        if self._stopping:
            return health.STOPPING
        return health.worst([engine.health() for engine in self._all])

    @property
    def ready(self) -> bool:
        """``health().ready``, read-only; for callers that only need yes or no."""
        return self.health().ready

    def health_of(self, model: str) -> Health:
        """One model's state, all its replicas together (STOPPING for all once the pool is stopping)."""
        if self._stopping:
            return health.STOPPING
        return health.worst([engine.health() for engine in self.replicas(model).engines])

    def begin_stopping(self) -> None:
        """Report STOPPING from now on, before :meth:`close`: probes take this replica out while
        in-flight generations finish."""
        self._stopping = True

    async def start(self) -> None:
        for engine in self._all:
            await engine.start()
        self.memory.fit(engine.info for engine in self._all if engine.info is not None)

    async def close(self) -> None:
        self._stopping = True
        for engine in self._all:
            await engine.close()

    def release(self, session_key: str) -> None:
        for replicas in self._models.values():
            replicas.release(session_key)

    def _make_room(self, newcomer: Ticket, short: int) -> None:
        """``newcomer``'s bytes are ``short`` short: pause a running request for it with its keys and
        values dropped, when the preemption rule allows one, and lend their bytes to the newcomer."""
        victim = self.admission.preempt_for_memory(newcomer, short)
        if victim is None or victim.memory is None:
            return
        victim.memory.lend(victim.droppable)
        victim.memory.regain(victim.droppable, functools.partial(self.admission.requeue, victim))

    async def generate(
        self, model: str | None, request: EngineRequest, share: Share = ANY
    ) -> AsyncGenerator[Event, None]:
        """Run ``request`` once admitted; ``share``: whose it is, for the fair share of a saturated pool."""
        replicas = self.replicas(model)
        info = replicas.engines[0].info
        cost = request_bytes(request.spec, len(request.tokens), info) if info is not None else 0
        ticket = self.admission.ticket(request.spec.priority, share)
        make_room = functools.partial(self._make_room, ticket)
        # bytes first: a request waiting for memory holds no slot a smaller one could use
        slot = self.admission.slot(request.spec.priority, share, ticket)
        async with self.memory.reserve(cost, make_room, key=share.key, order=ticket.order) as memory, slot:
            request = replace(request, rank=self.admission.rank(share))
            engine = replicas.pick(request)  # picked once a slot is held: loads are current
            stream = engine.generate(request)
            if isinstance(engine, Holdable):  # preemptible: the engine can pause it (and drop its cache)
                ticket.hold = functools.partial(engine.hold, request)
                ticket.memory = memory
                if info is not None:
                    ticket.droppable = kv_bytes(len(request.tokens) + request.spec.max_tokens, info)
            try:
                async for event in stream:
                    if isinstance(event, TokenEvent) and not event.is_prefill:
                        self.admission.fair.charge(share, 1)
                    elif isinstance(event, Done):
                        self.admission.fair.charge(share, prompt_cost(event.prefilled_tokens))
                    yield event
            finally:
                await stream.aclose()
