"""A fair share of a saturated pool across keys (tokens, weights), and a key's own limits."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any

import pytest

from prismgate.core.errors import Code, GatewayError
from prismgate.core.fairness import FairQueue, Share
from prismgate.core.memory import MemoryBudget
from prismgate.core.pool import Admission
from prismgate.core.principal import Principal
from prismgate.core.quota import LocalQuota

A, B = Share("a"), Share("b")


def future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


async def test_the_next_slot_goes_to_the_key_served_fewest_tokens() -> None:
    queue = FairQueue()
    a = [future() for _ in range(3)]
    for f in a:
        queue.push(A, 0, f)
    queue.charge(A, 500)  # a's running generations have produced 500 tokens
    b = future()
    queue.push(B, 0, b)  # b arrives last, behind three of a's
    assert queue.pop() is b
    assert queue.pop() is a[0]


async def test_equal_weights_split_tokens_evenly_whatever_the_request_sizes() -> None:
    """a's requests cost 100 tokens, b's 10: over time each key gets the same tokens, not the same requests."""
    queue = FairQueue()
    for _ in range(200):
        queue.push(A, 0, future())
        queue.push(B, 0, future())
    cost = {"a": 100, "b": 10}
    tokens = {"a": 0, "b": 0}
    owner = {id(f): k for k, q in queue._queues.items() for _, _, f in q}
    for _ in range(110):
        popped = queue.pop()
        assert popped is not None
        key = owner[id(popped)]
        queue.charge(Share(key), cost[key])
        tokens[key] += cost[key]
    assert abs(tokens["a"] - tokens["b"]) <= 100  # within one request of each other


async def test_weights_divide_the_tokens() -> None:
    queue = FairQueue()
    heavy, light = Share("heavy", 3.0), Share("light", 1.0)
    owner: dict[int, Share] = {}
    for _ in range(100):
        for share in (heavy, light):
            f = future()
            owner[id(f)] = share
            queue.push(share, 0, f)
    tokens = {"heavy": 0, "light": 0}
    for _ in range(80):
        popped = queue.pop()
        assert popped is not None
        share = owner[id(popped)]
        queue.charge(share, 10)
        tokens[share.key] += 10
    assert tokens["heavy"] == 3 * tokens["light"]


async def test_priorities_order_requests_within_a_key() -> None:
    queue = FairQueue()
    low, high = future(), future()
    queue.push(A, 10, low)
    queue.push(A, 0, high)
    assert queue.pop() is high and queue.pop() is low and queue.pop() is None


async def test_an_idle_key_banks_no_credit() -> None:
    queue = FairQueue()
    queue.push(A, 0, future())
    queue.charge(A, 1000)
    assert queue.pop() is not None  # a alone: served; the pool's virtual time is now 1000
    b = [future() for _ in range(3)]
    for f in b:
        queue.push(B, 0, f)  # b has been idle: it starts at 1000, not at 0
    later_a = future()
    queue.push(A, 0, later_a)
    queue.charge(B, 1)
    assert queue.pop() is later_a  # b's one token makes it the more served: b gets no run of three


async def test_admission_hands_a_freed_slot_to_the_starved_key() -> None:
    adm = Admission(max_active=1, max_queued=100)
    order: list[str] = []
    gate = asyncio.Event()

    async def job(name: str, share: Share) -> None:
        async with adm.slot(0, share):
            adm.fair.charge(share, 50)
            order.append(name)
            await gate.wait()

    tasks = [asyncio.create_task(job(f"a{i}", A)) for i in range(4)]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("b0", B)))
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(*tasks)
    assert order[:2] == ["a0", "b0"]  # b's request is next once a's first frees the slot


# -- a key's own limits ----------------------------------------------------------------------------


async def test_a_token_rate_refuses_until_the_window_ends_with_a_retry_hint() -> None:
    now = [120.0]
    quota = LocalQuota(clock=lambda: now[0])
    key = Principal("k", tokens_per_minute=100)
    await quota.admit(key, "r1")
    await quota.charge(key, 150)  # the generation that crosses the line finishes
    now[0] = 150.0
    with pytest.raises(GatewayError) as refused:
        await quota.admit(key, "r2")
    assert refused.value.code is Code.RESOURCE_EXHAUSTED and refused.value.retry_after_s == 30
    assert "retry after 30 s" in refused.value.message
    now[0] = 180.0  # the next minute
    await quota.admit(key, "r3")


async def test_a_concurrency_limit_counts_running_generations() -> None:
    quota = LocalQuota()
    key = Principal("k", max_concurrent=2)
    await quota.admit(key, "r1")
    await quota.admit(key, "r2")
    with pytest.raises(GatewayError) as refused:
        await quota.admit(key, "r3")
    assert refused.value.code is Code.RESOURCE_EXHAUSTED and refused.value.retry_after_s == 1
    await quota.admit(Principal("other", max_concurrent=2), "r3")  # another key has its own
    await quota.release(key, "r1")
    await quota.admit(key, "r3")


async def test_a_reserved_slot_lets_a_newcomer_start_at_once_while_another_key_fills_the_pool() -> None:
    adm = Admission(max_active=3, max_queued=100, reserved=1)
    gates = {name: asyncio.Event() for name in ("a0", "a1", "a2", "b0")}
    started: list[str] = []

    async def job(name: str, share: Share) -> None:
        async with adm.slot(0, share):
            started.append(name)
            await gates[name].wait()

    a = [asyncio.create_task(job(f"a{i}", A)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert started == ["a0", "a1"] and adm.active == 2 and adm.queued == 1  # a may not take the reserved slot
    b = asyncio.create_task(job("b0", B))
    await asyncio.sleep(0.01)
    assert started[-1] == "b0" and adm.active == 3  # b runs nothing: it starts at once, ahead of a's waiter
    gates["b0"].set()
    await b
    assert adm.active == 2 and adm.queued == 1  # the freed reserved slot is kept for the next newcomer
    gates["a0"].set()
    await asyncio.sleep(0.01)
    assert started[-1] == "a2" and adm.active == 2
    for gate in gates.values():
        gate.set()
    await asyncio.gather(*a)
    assert adm.active == 0


def test_a_chat_sized_prompt_is_free_and_a_long_one_costs_an_eighth_per_token() -> None:
    from prismgate.core.fairness import FREE_PROMPT_TOKENS, prompt_cost

    assert prompt_cost(0) == prompt_cost(35) == prompt_cost(FREE_PROMPT_TOKENS) == 0
    assert prompt_cost(FREE_PROMPT_TOKENS + 1) == 1  # rounded up
    assert prompt_cost(FREE_PROMPT_TOKENS + 8000) == 1000


# -- preemption ------------------------------------------------------------------------------------


class Holder:
    """What an engine's hold does, seen from the core: whether each request is held now."""

    def __init__(self) -> None:
        self.held: dict[str, bool] = {}
        self.dropped: list[str] = []  # held with their keys and values dropped

    def hold(self, name: str, held: bool, drop: bool = False) -> bool:
        self.held[name] = held
        if drop:
            self.dropped.append(name)
        return True


async def test_a_newcomer_key_takes_the_slot_of_the_key_holding_most_and_the_paused_one_goes_on_later() -> None:
    adm = Admission(max_active=3, max_queued=100)
    engine = Holder()
    gates: dict[str, asyncio.Event] = {}
    started: list[str] = []

    async def job(name: str, share: Share) -> None:
        gates[name] = asyncio.Event()
        async with adm.slot(0, share) as ticket:
            ticket.hold = functools.partial(engine.hold, name)
            started.append(name)
            await gates[name].wait()

    tasks = [asyncio.create_task(job(n, s)) for n, s in (("a0", A), ("a1", A), ("c0", Share("c")))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("a2", A)))  # a queues: a key already running preempts nobody
    await asyncio.sleep(0.01)
    assert started == ["a0", "a1", "c0"] and engine.held == {} and adm.queued == 1
    tasks.append(asyncio.create_task(job("b0", B)))
    await asyncio.sleep(0.01)
    assert started[-1] == "b0" and adm.active == 3 and adm.preemptions == 1
    assert engine.held == {"a1": True}  # a holds two slots, c one: a's latest is paused
    tasks.append(asyncio.create_task(job("a3", A)))
    tasks.append(asyncio.create_task(job("b1", B)))
    await asyncio.sleep(0.01)
    assert adm.preemptions == 1  # a has a request paused and b one running: neither is a newcomer
    gates["b0"].set()
    await asyncio.sleep(0.01)
    assert engine.held == {"a1": False} and started[-1] == "b0"  # the paused one goes first, in its old place
    for gate in gates.values():
        gate.set()
    await asyncio.gather(*tasks)
    assert adm.active == 0 and adm.queued == 0 and adm.fair.running("a") == 0


async def test_a_paused_request_that_leaves_holds_no_slot() -> None:
    adm = Admission(max_active=1, max_queued=100)
    engine = Holder()
    gate = asyncio.Event()

    async def job(name: str, share: Share) -> None:
        async with adm.slot(0, share) as ticket:
            ticket.hold = functools.partial(engine.hold, name)
            await gate.wait()

    a = asyncio.create_task(job("a0", A))
    await asyncio.sleep(0.01)
    b = asyncio.create_task(job("b0", B))
    await asyncio.sleep(0.01)
    assert engine.held == {"a0": True} and adm.active == 1
    a.cancel()  # a's client goes away while paused
    await asyncio.sleep(0.01)
    assert adm.active == 1 and adm.queued == 0
    gate.set()
    await b
    assert adm.active == 0 and engine.held == {"a0": True}  # never let go: it is gone


async def test_a_request_more_urgent_than_the_newcomer_is_never_preempted() -> None:
    adm = Admission(max_active=1, max_queued=100)
    engine = Holder()
    gate = asyncio.Event()

    async def job(name: str, share: Share, priority: int) -> None:
        async with adm.slot(priority, share) as ticket:
            ticket.hold = functools.partial(engine.hold, name)
            await gate.wait()

    tasks = [asyncio.create_task(job("a0", A, 0))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("b0", B, 5)))  # a higher value: less urgent than a's
    await asyncio.sleep(0.01)
    assert engine.held == {} and adm.preemptions == 0 and adm.queued == 1
    tasks.append(asyncio.create_task(job("c0", Share("c"), 0)))  # as urgent: a's is paused for it
    await asyncio.sleep(0.01)
    assert engine.held == {"a0": True} and adm.preemptions == 1
    gate.set()
    await asyncio.gather(*tasks)
    assert adm.active == 0 and adm.queued == 0


async def test_a_request_no_engine_can_pause_is_never_preempted() -> None:
    adm = Admission(max_active=1, max_queued=100)
    gate = asyncio.Event()
    started: list[str] = []

    async def job(name: str, share: Share) -> None:
        async with adm.slot(0, share):
            started.append(name)
            await gate.wait()

    tasks = [asyncio.create_task(job("a0", A))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("b0", B)))
    await asyncio.sleep(0.01)
    assert started == ["a0"] and adm.preemptions == 0
    gate.set()
    await asyncio.gather(*tasks)


async def pausable(
    adm: Admission, engine: Holder, name: str, share: Share, gate: asyncio.Event, started: list[str]
) -> None:
    """A request whose engine can pause it: holds its slot until ``gate`` is set."""
    async with adm.slot(0, share) as ticket:
        ticket.hold = functools.partial(engine.hold, name)
        started.append(name)
        await gate.wait()


async def test_with_preemption_off_a_newcomer_waits_for_a_slot_to_end() -> None:
    adm = Admission(max_active=1, max_queued=100, preemption=False)
    engine = Holder()
    gate = asyncio.Event()
    started: list[str] = []

    def job(name: str, share: Share) -> Coroutine[Any, Any, None]:
        return pausable(adm, engine, name, share, gate, started)

    tasks = [asyncio.create_task(job("a0", A))]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("b0", B)))  # with preemption on, a0 would be paused here
    await asyncio.sleep(0.01)
    assert started == ["a0"] and engine.held == {} and adm.preemptions == 0 and adm.queued == 1
    gate.set()
    await asyncio.gather(*tasks)
    assert started == ["a0", "b0"]


async def test_a_key_far_below_its_share_preempts_until_the_shares_are_level_and_never_back() -> None:
    adm = Admission(max_active=4, max_queued=100)
    engine = Holder()
    gate = asyncio.Event()
    started: list[str] = []

    def job(name: str, share: Share) -> Coroutine[Any, Any, None]:
        return pausable(adm, engine, name, share, gate, started)

    tasks = [asyncio.create_task(job(n, A)) for n in ("a0", "a1", "a2")]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("b0", B)))  # the last free slot
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("b1", B)))  # b holds 1, a 3: after the swap 2 and 2
    await asyncio.sleep(0.01)
    assert started[-1] == "b1" and adm.preemptions == 1 and engine.held == {"a2": True}
    tasks.append(asyncio.create_task(job("b2", B)))  # 3 against 1 after a swap: b would be over its share
    tasks.append(asyncio.create_task(job("a3", A)))  # a has a request paused: it takes nothing back
    await asyncio.sleep(0.01)
    assert adm.preemptions == 1 and adm.queued == 3 and started[-1] == "b1"
    gate.set()
    await asyncio.gather(*tasks)
    assert adm.active == 0 and adm.queued == 0


async def test_far_below_a_share_counts_slots_per_weight() -> None:
    adm = Admission(max_active=4, max_queued=100)
    engine = Holder()
    gate = asyncio.Event()
    started: list[str] = []
    heavy = Share("heavy", weight=3.0)

    def job(name: str, share: Share) -> Coroutine[Any, Any, None]:
        return pausable(adm, engine, name, share, gate, started)

    tasks = [asyncio.create_task(job(n, A)) for n in ("a0", "a1")]
    tasks += [asyncio.create_task(job(n, heavy)) for n in ("h0", "h1")]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(job("a2", A)))  # a holds 2 per weight, heavy 2/3: a is over its share
    await asyncio.sleep(0.01)
    assert adm.preemptions == 0 and adm.queued == 1
    tasks.append(asyncio.create_task(job("h2", heavy)))  # heavy after the swap: 3/3 = 1 <= (2 - 1)/1 for a
    await asyncio.sleep(0.01)
    assert adm.preemptions == 1 and engine.held == {"a1": True}
    gate.set()
    await asyncio.gather(*tasks)


async def test_a_newcomer_short_of_memory_pauses_one_whose_dropped_cache_frees_enough() -> None:
    """The rule is the slot preemption's, among the requests whose keys and values free the bytes short;
    the newcomer holds the paused one's slot at once, and the paused one queues again only when requeued
    (its bytes are back), then goes on when a slot is free."""
    adm = Admission(max_active=2, max_queued=100)
    budget = MemoryBudget(100)
    engine = Holder()
    gate = asyncio.Event()
    tickets: dict[str, Any] = {}

    async def job(name: str, droppable: int) -> None:
        async with budget.reserve(40) as memory, adm.slot(0, A) as ticket:
            ticket.hold = functools.partial(engine.hold, name)
            ticket.memory, ticket.droppable = memory, droppable
            tickets[name] = ticket
            await gate.wait()

    tasks = [asyncio.create_task(job("a0", 30)), asyncio.create_task(job("a1", 10))]
    await asyncio.sleep(0.01)
    newcomer = adm.ticket(0, B)
    assert adm.preempt_for_memory(newcomer, 31) is None and engine.held == {}  # no cache frees that much
    victim = adm.preempt_for_memory(newcomer, 20)
    assert victim is tickets["a0"] and engine.dropped == ["a0"] and newcomer.granted  # a1 is later, but frees 10
    assert adm.active == 2 and adm.preemptions == 1 and adm.recomputes == 1 and adm.queued == 0
    newcomer_done = asyncio.Event()

    async def b() -> None:
        async with adm.slot(0, B, newcomer):  # its slot is a0's: no wait
            await newcomer_done.wait()

    b_task = asyncio.create_task(b())
    await asyncio.sleep(0.01)
    assert adm.active == 2 and adm.fair.running("b") == 1
    adm.requeue(victim)  # its bytes are back: it waits for a slot, in its old place
    assert adm.queued == 1 and engine.held == {"a0": True}
    newcomer_done.set()
    await b_task
    await asyncio.sleep(0.01)
    assert engine.held == {"a0": False} and adm.active == 2 and adm.queued == 0
    gate.set()
    await asyncio.gather(*tasks)
    assert adm.active == 0 and budget.used == 0
