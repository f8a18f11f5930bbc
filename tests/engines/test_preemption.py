"""Preemption on the embedded engine: a newcomer key takes a running request's slot at once.

With every slot held by key a, a request of key b gets its first token before any of a's
requests ends; the a request paused for it goes on afterwards and ends with exactly the bits
of a run that was never paused (greedy and deterministic), and its client sees no error.
When b's memory is what is short, the paused request's keys and values are dropped and
recomputed before it goes on: a deterministic one still ends with exactly those bits.
The order of events is asserted, never a time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineRequest
from prismgate.core.events import Done, FinishReason, TokenEvent
from prismgate.core.fairness import Share
from prismgate.core.memory import kv_bytes, request_bytes
from prismgate.core.pool import EnginePool
from prismgate.engines.hf import TransformersEngine
from tests.engines.requests import chat
from tests.engines.test_determinism import fingerprint

pytestmark = pytest.mark.asyncio(loop_scope="module")

A, B = Share("a"), Share("b")
LONG = 96  # a's generations: long enough that b arrives while both still run
SHORT = 24  # b's: unpaused, a's two would have stepped this often beside it, round by round


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool(long_model_dir: Path, tiny_pack: Path) -> AsyncIterator[EnginePool]:
    engine = TransformersEngine(
        long_model_dir,
        model_id="tiny-llama",
        concept_pack=tiny_pack,
        dtype="bfloat16",
        threads=1,
        max_batch=1,  # a greedy request's bits then depend on no neighbour: paused or not, they must match
    )
    pool = EnginePool([engine], max_active=2, reserved_slots=0)
    await pool.start()
    yield pool
    await pool.close()


def spec(deterministic: bool, max_tokens: int) -> GenerateSpec:
    everything = (PositionRange(0, 10_000),)
    return GenerateSpec(
        max_tokens=max_tokens,
        ignore_eos=True,
        deterministic=deterministic,
        logprob_ranges=everything,
        logprob_top_k=3,
        readout_ranges=everything,
    )


async def consume(
    pool: EnginePool, name: str, request: EngineRequest, share: Share, log: list[tuple[str, str]]
) -> tuple[list[TokenEvent], Done]:
    """Run ``request`` through the pool as ``share``, logging each generated token and its end."""
    events: list[TokenEvent] = []
    async for event in pool.generate(None, request, share):
        if name == "b" and not events:
            log.append((name, f"memory {pool.memory.used}"))  # what the budget counts while a's one is paused
        if isinstance(event, Done):
            log.append((name, "done"))
            return events, event
        if not event.is_prefill:
            log.append((name, "token" if any(not e.is_prefill for e in events) else "first"))
        events.append(event)
    raise AssertionError("the stream ended without Done")


def request(engine: Any, text: str, deterministic: bool, max_tokens: int) -> EngineRequest:
    return EngineRequest(uuid.uuid4().hex, chat(engine, text), spec(deterministic, max_tokens))


TEXTS = ("Tell me a long story about rivers.", "List every colour you know.")  # a's two requests


async def unpaused(pool: EnginePool, deterministic: bool) -> list[tuple[list[TokenEvent], Done]]:
    """a's two requests, each run alone: what they must produce when paused."""
    engine = pool.engine()
    return [await consume(pool, f"ref{i}", request(engine, t, deterministic, LONG), A, []) for i, t in enumerate(TEXTS)]


async def generating(log: list[tuple[str, str]], count: int) -> None:
    """Wait until ``count`` requests have their first token (both of a's hold a slot and generate)."""
    for _ in range(6000):
        if sum(1 for _, what in log if what == "first") == count:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("deterministic", [False, True], ids=["greedy", "deterministic"])
async def test_a_newcomer_key_preempts_and_the_paused_request_keeps_its_bits(
    pool: EnginePool, deterministic: bool
) -> None:
    engine = pool.engine()
    alone = await unpaused(pool, deterministic)

    log: list[tuple[str, str]] = []
    before = pool.admission.preemptions
    a = [
        asyncio.create_task(consume(pool, f"a{i}", request(engine, t, deterministic, LONG), A, log))
        for i, t in enumerate(TEXTS)
    ]
    await generating(log, 2)
    assert sorted(what for _, what in log if what != "token") == ["first", "first"], log
    held = pool.memory.used  # a's two requests
    newcomer = request(engine, "Hi.", deterministic, SHORT)
    b = await asyncio.wait_for(consume(pool, "b", newcomer, B, log), 300)
    done = await asyncio.wait_for(asyncio.gather(*a), 300)

    assert log.index(("b", "first")) < min(log.index((f"a{i}", "done")) for i in range(2)), log
    assert pool.admission.preemptions == before + 1
    assert b[1].finish_reason is FinishReason.LENGTH and b[1].completion_tokens == SHORT
    # the paused request's memory stays counted: b's first event came with all three reserved
    with_b = held + request_bytes(newcomer.spec, len(newcomer.tokens), engine.info)
    assert held > 0 and next(what for _, what in log if what.startswith("memory")) == f"memory {with_b}"
    # while b ran, one of a's requests was held by the engine: a token or two already under way, no more
    during = log[log.index(("b", "first")) : log.index(("b", "done"))]
    assert min(sum(1 for name, _ in during if name == f"a{i}") for i in range(2)) <= 3, during
    for (events, end), (ref_events, _) in zip(done, alone, strict=True):
        assert end.finish_reason is FinishReason.LENGTH and end.completion_tokens == LONG  # a's clients saw no error
        assert fingerprint(events) == fingerprint(ref_events)  # paused or not: the same ids, logprobs, readouts
    assert pool.admission.active == 0 and pool.admission.queued == 0


@pytest.mark.parametrize("deterministic", [False, True], ids=["greedy", "deterministic"])
async def test_when_memory_is_short_the_paused_request_is_dropped_and_recomputed(
    pool: EnginePool, deterministic: bool
) -> None:
    engine = pool.engine()
    alone = await unpaused(pool, deterministic)
    a_requests = [request(engine, t, deterministic, LONG) for t in TEXTS]
    newcomer = request(engine, "Hi.", deterministic, SHORT)
    costs = [request_bytes(r.spec, len(r.tokens), engine.info) for r in (*a_requests, newcomer)]
    droppable = min(kv_bytes(len(r.tokens) + LONG, engine.info) for r in a_requests)
    assert 0 < droppable < costs[2]
    tight = sum(costs) - droppable  # b fits only if one of a's requests drops its keys and values
    limit, pool.memory.limit = pool.memory.limit, tight
    stats = dict(engine.stats)
    before = (pool.admission.preemptions, pool.admission.recomputes)
    log: list[tuple[str, str]] = []
    try:
        a = [asyncio.create_task(consume(pool, f"a{i}", r, A, log)) for i, r in enumerate(a_requests)]
        await generating(log, 2)
        assert sorted(what for _, what in log if what != "token") == ["first", "first"], log
        b = await asyncio.wait_for(consume(pool, "b", newcomer, B, log), 300)
        done = await asyncio.wait_for(asyncio.gather(*a), 300)
    finally:
        pool.memory.limit = limit

    assert log.index(("b", "first")) < min(log.index((f"a{i}", "done")) for i in range(2)), log
    assert (pool.admission.preemptions, pool.admission.recomputes) == (before[0] + 1, before[1] + 1)
    assert b[1].finish_reason is FinishReason.LENGTH and b[1].completion_tokens == SHORT
    # b ran within the budget: the dropped request's keys and values were lent to it
    lent = {f"memory {sum(costs) - kv_bytes(len(r.tokens) + LONG, engine.info)}" for r in a_requests}
    assert next(what for _, what in log if what.startswith("memory")) in lent
    assert all(int(what.split()[1]) <= tight for what in lent)
    dropped = engine.stats["dropped_tokens"] - stats["dropped_tokens"]
    assert dropped > 0 and engine.stats["recomputed_tokens"] - stats["recomputed_tokens"] == dropped
    for (events, end), (ref_events, _) in zip(done, alone, strict=True):
        assert end.finish_reason is FinishReason.LENGTH and end.completion_tokens == LONG  # a's clients saw no error
        # nothing sent twice, nothing missing: one event per position, prompt and generated
        assert [e.position for e in events] == [e.position for e in ref_events]
        if deterministic:  # its recomputed cache holds the same bits: so do its tokens, logprobs, readouts
            assert fingerprint(events) == fingerprint(ref_events)
    assert pool.admission.active == 0 and pool.admission.queued == 0 and pool.memory.used == 0


async def test_freed_memory_goes_to_the_key_served_least_not_to_the_oldest_waiter(pool: EnginePool) -> None:
    """Bytes before slots: with a's requests waiting for memory, a request of b that arrives after them
    gets the next freed bytes (and so its first token) before any of them; nothing is preempted here."""
    engine = pool.engine()
    a_requests = [request(engine, f"Tell me story number {i} about rivers.", False, LONG) for i in range(5)]
    newcomer = request(engine, "Hi.", False, SHORT)
    cost = max(request_bytes(r.spec, len(r.tokens), engine.info) for r in (*a_requests, newcomer))
    saved = pool.memory.limit, pool.admission.preemption
    pool.memory.limit, pool.admission.preemption = 3 * cost, False  # a0, a1 run, a2 waits for a slot
    log: list[tuple[str, str]] = []
    try:
        a = [asyncio.create_task(consume(pool, f"a{i}", r, A, log)) for i, r in enumerate(a_requests)]
        await generating(log, 2)  # two of a's requests are generating, the rest wait
        assert pool.memory.waiting == 2 and pool.admission.queued == 1, log  # a3, a4 wait for bytes
        b = asyncio.create_task(consume(pool, "b", newcomer, B, log))
        await asyncio.sleep(0.05)
        assert pool.memory.waiting == 3 and ("b", "first") not in log
        await asyncio.wait_for(asyncio.gather(b, *a), 300)
    finally:
        pool.memory.limit, pool.admission.preemption = saved
    firsts = [name for name, what in log if what == "first"]
    assert firsts.index("b") < firsts.index("a3") and firsts.index("b") < firsts.index("a4"), firsts
    assert pool.memory.used == 0 and pool.admission.active == 0


async def test_a_request_dropped_mid_prompt_recomputes_its_chunks_and_sends_each_position_once(
    long_model_dir: Path, tiny_pack: Path
) -> None:
    """Dropped between two of its prompt's chunks (scored and read out at every position), a deterministic
    request recomputes what it had, goes on with the rest of its prompt, and ends with its unpaused bits."""
    engine = TransformersEngine(
        long_model_dir, model_id="tiny-llama", concept_pack=tiny_pack, dtype="bfloat16", threads=1, prefill_chunk=64
    )
    engine.step_target_ms = 0  # full chunks: 20 of them
    await engine.start()
    try:
        words = " ".join(f"river{i % 50}" for i in range(1200))
        tokens = chat(engine, words)[:1280]

        async def once(drop: bool) -> list[TokenEvent]:
            req = EngineRequest(uuid.uuid4().hex, tokens, spec(True, 8))
            events: list[TokenEvent] = []
            async for event in engine.generate(req):
                if isinstance(event, Done):
                    assert event.completion_tokens == 8
                    return events
                if drop and not events:  # the first chunk's events are out: drop it at its next step boundary
                    assert engine.hold(req, True, drop=True)
                    await asyncio.sleep(0.2)
                    assert engine.hold(req, False)
                events.append(event)
            raise AssertionError("the stream ended without Done")

        alone = await once(False)
        before = dict(engine.stats)
        dropped = await once(True)
    finally:
        await engine.close()
    lost = engine.stats["dropped_tokens"] - before["dropped_tokens"]
    assert 0 < lost < len(tokens)  # dropped part-way through its prompt
    assert engine.stats["recomputed_tokens"] - before["recomputed_tokens"] == lost
    assert [e.position for e in dropped] == list(range(len(tokens) + 8))  # every position once
    assert fingerprint(dropped) == fingerprint(alone)


async def test_requests_reach_the_engine_ranked_by_the_slots_their_key_holds_beside_them(pool: EnginePool) -> None:
    """The pool's rank (EngineRequest.rank, the order in which the engine begins newcomers): a's second
    request, beside one more of a's (weight 2), ranks 0.5; b's, preempting with nothing else running, 0."""
    engine = pool.engine()
    ranks: dict[str, float] = {}
    generate = engine.generate

    def ranked(request: EngineRequest) -> Any:
        ranks[request.request_id] = request.rank
        return generate(request)

    heavy = Share("a", weight=2.0)
    a_requests = [request(engine, t, False, LONG) for t in TEXTS]
    newcomer = request(engine, "Hi.", False, SHORT)
    log: list[tuple[str, str]] = []
    engine.generate = ranked  # type: ignore[method-assign]
    try:
        a = [asyncio.create_task(consume(pool, f"a{i}", r, heavy, log)) for i, r in enumerate(a_requests)]
        await generating(log, 2)
        await asyncio.wait_for(consume(pool, "b", newcomer, B, log), 300)
        await asyncio.wait_for(asyncio.gather(*a), 300)
    finally:
        del engine.generate
    assert sorted(ranks[r.request_id] for r in a_requests) == [0.0, 0.5]
    assert ranks[newcomer.request_id] == 0.0
