"""What only the vLLM engine has to prove: prefix reuse survives logprobs and readouts,
values from the cache are never missing, no request leaks, priorities hold.

The conformance suite (test_conformance.py with PRISMGATE_TEST_ENGINES=vllm) covers the
shared contract; these tests look at the vLLM-specific machinery through the engine's
own counters (``stats``, ``in_flight()``, ``unfinished_requests()``) and the side
channel's ``rows_seen``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from prismgate.core import checks
from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, FinishReason, TokenEvent
from tests.engines.vllm_factory import make_vllm_engine

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

SAME = 1e-4  # the same positions computed by two paths (cache/store vs recompute), float32


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir: Path, tiny_pack: Path) -> Any:
    eng = make_vllm_engine(tiny_model_dir, concept_pack=tiny_pack)
    await eng.start()
    yield eng
    await eng.close()


def request(tokens: tuple[int, ...], session: str | None = None, **spec: Any) -> EngineRequest:
    return EngineRequest(uuid.uuid4().hex, tokens, GenerateSpec(**spec), session_key=session)


async def run(
    engine: Any, tokens: tuple[int, ...], session: str | None = None, **spec: Any
) -> tuple[list[TokenEvent], Done]:
    events: list[TokenEvent] = []
    async for ev in engine.generate(request(tokens, session, **spec)):
        if isinstance(ev, Done):
            return events, ev
        events.append(ev)
    raise AssertionError("no Done")


def text_tokens(engine: Any, text: str, length: int) -> tuple[int, ...]:
    ids = engine.info.tokenizer.encode(text)
    return tuple((ids * (length // len(ids) + 1))[:length])


def decoded(events: list[TokenEvent]) -> list[int]:
    return [e.id for e in events if not e.is_prefill]


async def test_info_and_cache_granularity(engine: Any) -> None:
    assert engine.info.engine_name == "vllm"
    assert engine.info.max_model_len == 512  # vLLM itself runs 513: one spare position for the look-ahead step
    assert engine.cache_block_size == 32


async def test_the_workers_loaded_memory_moved_into_huge_pages(engine: Any) -> None:
    """vLLM's CPU worker, once loaded, compiled and with its KV cache, moves its memory into 2 MiB pages."""
    info = engine.info
    if info.huge_pages_reason.startswith("not collapsed: madvise"):
        pytest.skip(info.huge_pages_reason)  # a kernel older than 6.1, or without huge pages
    assert info.huge_page_bytes > 0, info.huge_pages_reason
    assert info.huge_pages_reason.startswith(f"{info.huge_page_bytes >> 20} MiB of weights"), info.huge_pages_reason


async def test_vllm_cpu_refuses_deterministic_requests_and_says_where_to_go(engine: Any) -> None:
    assert engine.info.deterministic is False
    assert "--engine transformers" in (engine.info.deterministic_off or "")
    with pytest.raises(GatewayError) as refused:
        checks.resolve_deterministic(engine.info, GenerateSpec(deterministic=True), default=False)
    assert refused.value.code is Code.FAILED_PRECONDITION and "VLLM_BATCH_INVARIANT" in refused.value.message


async def test_prompt_logprobs_keep_the_prefix_cache(engine: Any) -> None:
    """The trap: vLLM's prompt_logprobs turns prefix-cache reads off. Ours must not."""
    key = uuid.uuid4().hex
    t1 = text_tokens(engine, "a long shared history ", 100)
    out1, done1 = await run(engine, t1, session=key, max_tokens=4, ignore_eos=True)
    history = t1 + tuple(decoded(out1))
    t2 = history + text_tokens(engine, "new question", 12)
    n2 = len(t2)
    skips, rescored = engine.stats["cache_skips"], engine.stats["rescored"]
    asked = (PositionRange(len(history), n2 + 3),)
    events, done2 = await run(
        engine, t2, session=key, max_tokens=3, ignore_eos=True, logprob_ranges=asked, logprob_top_k=3
    )
    assert done1.cached_tokens == 0
    assert done2.cached_tokens == (len(history) - 1) // 32 * 32 == 96  # whole blocks of the history came from cache
    assert done2.prefilled_tokens == n2 - 96
    assert engine.stats["cache_skips"] == skips and engine.stats["rescored"] == rescored
    prefill = [e for e in events if e.is_prefill]
    assert [e.position for e in prefill] == list(range(len(history), n2))
    # the same positions with no cache at all (an ephemeral request never hits)
    fresh, done_f = await run(engine, t2, max_tokens=3, ignore_eos=True, logprob_ranges=asked, logprob_top_k=3)
    assert done_f.cached_tokens == 0
    assert [(e.position, e.id) for e in fresh] == [(e.position, e.id) for e in events]
    for a, b in zip(events, fresh, strict=True):
        assert a.logprob is not None and b.logprob is not None and abs(a.logprob - b.logprob) < SAME
        assert a.top_logprobs is not None and b.top_logprobs is not None
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


async def test_readouts_for_cached_positions_come_from_the_session_store(engine: Any) -> None:
    key = uuid.uuid4().hex
    t1 = text_tokens(engine, "readouts kept per session ", 80)
    everything = (PositionRange(0, 200),)
    out1, _ = await run(engine, t1, session=key, max_tokens=4, ignore_eos=True, readout_ranges=(PositionRange(0, 84),))
    first = {e.position: e.readout for e in out1}
    assert sorted(first) == list(range(84))
    t2 = t1 + tuple(decoded(out1)) + text_tokens(engine, "next", 5)
    skips = engine.stats["cache_skips"]
    events, done = await run(engine, t2, session=key, max_tokens=0, readout_ranges=everything)
    assert done.cached_tokens == 64 and engine.stats["cache_skips"] == skips  # reused, not recomputed
    assert [e.position for e in events] == list(range(len(t2)))
    for e in events:
        assert e.readout is not None
        if e.position in first:  # from the store (cached) or recomputed: the same numbers
            assert np.allclose(e.readout, first[e.position], atol=SAME), e.position


async def test_asking_for_an_old_position_the_store_lacks_skips_the_cache(engine: Any) -> None:
    key = uuid.uuid4().hex
    t1 = text_tokens(engine, "logprobs were never asked for here ", 90)
    out1, _ = await run(engine, t1, session=key, max_tokens=2, ignore_eos=True)
    t2 = t1 + tuple(decoded(out1)) + (65, 66)
    skips = engine.stats["cache_skips"]
    events, done = await run(engine, t2, session=key, max_tokens=0, logprob_ranges=(PositionRange(5, 8),))
    assert engine.stats["cache_skips"] == skips + 1 and done.cached_tokens == 0
    assert [e.position for e in events] == [5, 6, 7] and all(e.logprob is not None for e in events)
    # asked again: now the store has them, so the cache is used
    again, done2 = await run(engine, t2, session=key, max_tokens=0, logprob_ranges=(PositionRange(5, 8),))
    assert done2.cached_tokens > 0 and engine.stats["cache_skips"] == skips + 1
    assert [e.logprob for e in again] == [e.logprob for e in events]


async def test_continuous_batching_keeps_each_sessions_readouts(engine: Any) -> None:
    prompts = [text_tokens(engine, f"session number {i} says ", 40 + 9 * i) for i in range(3)]
    specs = [
        {"max_tokens": 6, "ignore_eos": True, "readout_ranges": (PositionRange(len(p) - 4, len(p) + 6),)}
        for p in prompts
    ]
    alone = [await run(engine, p, **s) for p, s in zip(prompts, specs, strict=True)]
    together = await asyncio.gather(
        *(run(engine, p, session=uuid.uuid4().hex, **s) for p, s in zip(prompts, specs, strict=True))
    )
    for (a_events, _), (b_events, _) in zip(alone, together, strict=True):
        assert [(e.position, e.id) for e in a_events] == [(e.position, e.id) for e in b_events]
        for a, b in zip(a_events, b_events, strict=True):
            assert a.readout is not None and b.readout is not None
            assert np.allclose(a.readout, b.readout, atol=SAME), a.position


async def test_context_edges(engine: Any) -> None:
    limit = engine.info.max_model_len
    with pytest.raises(GatewayError) as err:
        await run(engine, text_tokens(engine, "too long ", limit - 2), max_tokens=3)
    assert err.value.code is Code.RESOURCE_EXHAUSTED
    assert engine.in_flight() == 0 and engine.unfinished_requests() == 0
    # the full context, prefill only: vLLM still needs room for one (discarded) token
    full = text_tokens(engine, "exactly full ", limit)
    events, done = await run(engine, full, max_tokens=0, readout_ranges=(PositionRange(limit - 1, limit),))
    assert done.finish_reason is FinishReason.PREFILL_ONLY and [e.position for e in events] == [limit - 1]
    # decoding up to the last position still gets the last token's readout (look-ahead step)
    p = full[: limit - 3]
    events, done = await run(
        engine, p, max_tokens=3, ignore_eos=True, readout_ranges=(PositionRange(limit - 1, limit),)
    )
    assert done.completion_tokens == 3 and events[-1].position == limit - 1 and events[-1].readout is not None


async def test_a_readout_on_the_eos_token_still_arrives(engine: Any) -> None:
    p = text_tokens(engine, "stop on me ", 30)
    free, _ = await run(engine, p, max_tokens=6, ignore_eos=True)
    stop = decoded(free)[2]
    n = len(p)
    events, done = await run(engine, p, max_tokens=6, stop_token_ids=(stop,), readout_ranges=(PositionRange(n, n + 6),))
    assert done.finish_reason is FinishReason.EOS and events[-1].id == stop
    assert all(e.readout is not None for e in events)
    assert engine.in_flight() == 0


async def test_cancelling_mid_stream_aborts_inside_vllm(engine: Any) -> None:
    p = text_tokens(engine, "cancel me ", 20)
    n = len(p)
    stream = engine.generate(request(p, max_tokens=400, ignore_eos=True, readout_ranges=(PositionRange(0, n + 400),)))
    got = 0
    async for ev in stream:
        got += isinstance(ev, TokenEvent) and not ev.is_prefill
        if got == 3:
            break
    await stream.aclose()
    assert engine.in_flight() == 0 and engine.unfinished_requests() == 0
    key = max(engine._receiver.rows_seen, key=lambda k: int(k[2:].rstrip("r")))
    seen = engine._receiver.rows_seen[key]
    await asyncio.sleep(0.5)
    settled = engine._receiver.rows_seen[key]
    assert settled <= seen + 1  # at most the step that was already running when the abort arrived
    await asyncio.sleep(0.5)
    assert engine._receiver.rows_seen[key] == settled  # and nothing after it
    assert seen < n + 50


async def test_cancelling_the_consumer_task_aborts_too(engine: Any) -> None:
    p = text_tokens(engine, "task cancel ", 20)
    started = asyncio.Event()

    async def consume() -> None:
        async for ev in engine.generate(request(p, max_tokens=400, ignore_eos=True)):
            if isinstance(ev, TokenEvent):
                started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for _ in range(50):
        if engine.unfinished_requests() == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.in_flight() == 0 and engine.unfinished_requests() == 0


async def test_text_model_takes_no_images(engine: Any) -> None:
    with pytest.raises(GatewayError) as err:
        engine.image_tokens(b"\x89PNG", "image/png")
    assert err.value.code is Code.INVALID_ARGUMENT and "no vision encoder" in err.value.message


async def test_eager_mode_on_request_gives_the_compiled_graphs_values_and_sizes_memory_itself(
    engine: Any, tiny_model_dir: Path, tiny_pack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``enforce_eager`` is an opt-in; with no KV-cache size and no ``VLLM_CPU_KVCACHE_SPACE`` the
    engine still starts on CPU, its KV cache a share of the memory free now."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    from prismgate.engines.vllm import config

    fraction = 0.05
    free = config.available_memory()
    eager = make_vllm_engine(
        tiny_model_dir, concept_pack=tiny_pack, enforce_eager=True, kv_cache_gb=None, gpu_memory_utilization=fraction
    )
    await eager.start()
    try:
        vllm_config = eager._llm.vllm_config
        assert vllm_config.model_config.enforce_eager and not engine._llm.vllm_config.model_config.enforce_eager
        kv = vllm_config.cache_config.kv_cache_memory_bytes
        assert 0.5 * fraction * free < kv <= fraction * free
        p = text_tokens(engine, "eager or compiled ", 40)
        spec: dict[str, Any] = {
            "max_tokens": 6,
            "ignore_eos": True,
            "readout_ranges": (PositionRange(0, 46),),
            "logprob_ranges": (PositionRange(30, 46),),
            "logprob_top_k": 2,
        }
        compiled_events, _ = await run(engine, p, **spec)
        eager_events, _ = await run(eager, p, **spec)
        assert [e.id for e in eager_events] == [e.id for e in compiled_events]
        for a, b in zip(compiled_events, eager_events, strict=True):
            assert a.readout is not None and b.readout is not None
            np.testing.assert_allclose(a.readout, b.readout, rtol=SAME, atol=SAME)
            assert (a.logprob is None) == (b.logprob is None)
            if a.logprob is not None and b.logprob is not None:
                assert abs(a.logprob - b.logprob) <= SAME
    finally:
        await eager.close()


# -- a second engine: one sequence at a time (priorities visible), prefixes shared globally --


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serial(tiny_model_dir: Path, tiny_pack: Path) -> Any:
    eng = make_vllm_engine(tiny_model_dir, concept_pack=tiny_pack, max_num_seqs=1, cache_scope="global")
    await eng.start()
    yield eng
    await eng.close()


async def test_priority_orders_waiting_requests(serial: Any) -> None:
    finished: list[str] = []

    async def go(name: str, tokens: tuple[int, ...], priority: int, max_tokens: int, first: asyncio.Event) -> None:
        async for ev in serial.generate(request(tokens, max_tokens=max_tokens, ignore_eos=True, priority=priority)):
            first.set()
            if isinstance(ev, Done):
                finished.append(name)

    running = asyncio.Event()
    blocker = asyncio.create_task(go("blocker", text_tokens(serial, "blocker ", 20), 0, 60, running))
    await asyncio.wait_for(running.wait(), 30)
    low = asyncio.create_task(go("low", text_tokens(serial, "low ", 20), 10, 2, asyncio.Event()))
    await asyncio.sleep(0.05)
    high = asyncio.create_task(go("high", text_tokens(serial, "high ", 20), -10, 2, asyncio.Event()))
    await asyncio.gather(blocker, low, high)
    assert finished.index("high") < finished.index("low")


async def test_values_served_from_another_sessions_cache_are_rescored(serial: Any) -> None:
    shared = text_tokens(serial, "a system prompt every session shares ", 70)
    await run(serial, shared, session=uuid.uuid4().hex, max_tokens=1, ignore_eos=True)
    rescored = serial.stats["rescored"]
    other = (*shared, 65, 66, 67)
    asked = {"readout_ranges": (PositionRange(3, 6),), "logprob_ranges": (PositionRange(3, 6),), "logprob_top_k": 2}
    events, done = await run(serial, other, session=uuid.uuid4().hex, max_tokens=0, **asked)
    assert done.cached_tokens == 64  # the other session's blocks were reused...
    assert serial.stats["rescored"] == rescored + 1  # ...so the asked-for prefix was recomputed once
    assert [e.position for e in events] == [3, 4, 5]
    fresh, _ = await run(serial, other, max_tokens=0, **asked)  # ephemeral, global scope: also hits, also rescored
    for a, b in zip(events, fresh, strict=True):
        assert a.readout is not None and b.readout is not None and np.allclose(a.readout, b.readout, atol=SAME)
        assert a.logprob is not None and b.logprob is not None and abs(a.logprob - b.logprob) < SAME


async def test_close_ends_in_flight_streams_cancelled(serial: Any) -> None:
    events: list[Any] = []
    started = asyncio.Event()

    async def consume() -> None:
        async for ev in serial.generate(request(text_tokens(serial, "closing ", 20), max_tokens=400, ignore_eos=True)):
            events.append(ev)
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 30)
    await serial.close()
    await asyncio.wait_for(task, 30)
    assert isinstance(events[-1], Done) and events[-1].finish_reason is FinishReason.CANCELLED
    with pytest.raises(GatewayError) as err:
        await run(serial, (65, 66), max_tokens=1)
    assert err.value.code is Code.UNAVAILABLE
