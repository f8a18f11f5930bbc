"""The Engine contract, run against every engine (see conftest.engine_names).

The tiny model has random weights: assertions are about ids, positions, shapes and
consistency between paths (cached vs recomputed, prefill vs decode), never words.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import FinishReason, TokenEvent
from prismgate.core.health import HealthState
from tests.engines.conftest import with_eos
from tests.engines.requests import run

pytestmark = [pytest.mark.engine_suite, pytest.mark.asyncio(loop_scope="module")]

LOGPROB_TOL = 2e-3
READOUT_TOL = 2e-3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(engine_factory: Any, tiny_model_dir: Path, tiny_pack: Path) -> Any:
    eng = engine_factory(tiny_model_dir, tiny_pack)
    await eng.start()
    yield eng
    await eng.close()


def prompt(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": text}]))


def decoded(events: list[TokenEvent]) -> list[int]:
    return [e.id for e in events if not e.is_prefill]


async def test_info_describes_the_model(engine: Any) -> None:
    info = engine.info
    assert info.model_id == "tiny-llama"
    assert info.max_model_len == 512
    assert info.vocab_size >= 259
    assert info.eos_token_ids
    assert info.readouts is not None and info.readouts.shape == (2, 3)
    assert info.tokenizer.decode(info.tokenizer.encode("héllo")) == "héllo"


async def test_health_is_loading_until_started_then_ready(
    engine: Any, engine_factory: Any, tiny_model_dir: Path, tiny_pack: Path
) -> None:
    unstarted = engine_factory(tiny_model_dir, tiny_pack)
    assert unstarted.health().state is HealthState.LOADING and not unstarted.health().ready
    with pytest.raises(GatewayError) as refused:
        await run(unstarted, (1, 2, 3), max_tokens=1)
    assert refused.value.code is Code.UNAVAILABLE
    assert engine.health().state is HealthState.READY and engine.health().ready


async def test_greedy_is_deterministic_and_positions_follow_the_prompt(engine: Any) -> None:
    p = prompt(engine, "determinism")
    a, done_a = await run(engine, p, max_tokens=12, ignore_eos=True)
    b, _ = await run(engine, p, max_tokens=12, ignore_eos=True)
    assert decoded(a) == decoded(b)
    assert [e.position for e in a] == list(range(len(p), len(p) + 12))
    assert all(not e.is_prefill for e in a)
    assert done_a.prompt_tokens == len(p) and done_a.completion_tokens == 12
    assert done_a.finish_reason is FinishReason.LENGTH


async def test_max_tokens_bounds_the_output(engine: Any) -> None:
    for n in (1, 5):
        events, done = await run(engine, prompt(engine, "budget"), max_tokens=n, ignore_eos=True)
        assert len(decoded(events)) == n == done.completion_tokens
        assert done.finish_reason is FinishReason.LENGTH


async def test_seeded_sampling_is_reproducible(engine: Any) -> None:
    p = prompt(engine, "sampling")
    a, _ = await run(engine, p, max_tokens=10, temperature=1.5, seed=7, ignore_eos=True)
    b, _ = await run(engine, p, max_tokens=10, temperature=1.5, seed=7, ignore_eos=True)
    c, _ = await run(engine, p, max_tokens=10, temperature=1.5, seed=8, ignore_eos=True)
    assert decoded(a) == decoded(b)
    assert decoded(a) != decoded(c)


async def test_top_k_one_is_greedy(engine: Any) -> None:
    p = prompt(engine, "topk")
    greedy, _ = await run(engine, p, max_tokens=8, ignore_eos=True)
    topk, _ = await run(engine, p, max_tokens=8, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    assert decoded(greedy) == decoded(topk)


async def test_stop_token_ids_end_generation_on_that_token(engine: Any) -> None:
    p = prompt(engine, "stop ids")
    free, _ = await run(engine, p, max_tokens=10, ignore_eos=True)
    ids = decoded(free)
    stop = ids[3]
    first = ids.index(stop)
    events, done = await run(engine, p, max_tokens=10, stop_token_ids=(stop,), ignore_eos=True)
    assert decoded(events) == ids[: first + 1]
    assert done.finish_reason is FinishReason.EOS


async def test_eos_ends_generation(
    engine_factory: Any, engine: Any, tiny_model_dir: Path, tiny_pack: Path, tmp_path: Path
) -> None:
    p = prompt(engine, "eos")
    free, _ = await run(engine, p, max_tokens=8, ignore_eos=True)
    ids = decoded(free)
    eos = ids[2]
    other = engine_factory(with_eos(tiny_model_dir, tmp_path / "eos-model", eos), tiny_pack)
    await other.start()
    try:
        assert eos in other.info.eos_token_ids
        events, done = await run(other, p, max_tokens=8)
        assert decoded(events) == ids[: ids.index(eos) + 1]
        assert done.finish_reason is FinishReason.EOS
        ignored, done2 = await run(other, p, max_tokens=8, ignore_eos=True)
        assert decoded(ignored) == ids and done2.finish_reason is FinishReason.LENGTH
    finally:
        await other.close()


async def test_prefill_only_reports_covered_positions(engine: Any) -> None:
    p = prompt(engine, "score me")
    events, done = await run(
        engine,
        p,
        max_tokens=0,
        logprob_ranges=(PositionRange(0, 3), PositionRange(10, 12)),
        logprob_top_k=4,
    )
    assert [e.position for e in events] == [0, 1, 2, 10, 11]
    assert all(e.is_prefill for e in events)
    assert [e.id for e in events] == [p[i] for i in (0, 1, 2, 10, 11)]
    assert events[0].logprob is None  # nothing predicts the first token
    for e in events[1:]:
        assert e.logprob is not None and e.logprob <= 0
        assert e.top_logprobs is not None and len(e.top_logprobs) == 4
        values = [v for _, v in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.logprob <= values[0] + 1e-6
    assert done.completion_tokens == 0 and done.finish_reason is FinishReason.PREFILL_ONLY


async def test_decode_logprobs_are_consistent_with_rescoring(engine: Any) -> None:
    p = prompt(engine, "consistency")
    n = len(p)
    events, _ = await run(
        engine, p, max_tokens=6, ignore_eos=True, logprob_ranges=(PositionRange(n, n + 6),), logprob_top_k=3
    )
    for e in events:
        assert e.top_logprobs is not None and e.logprob is not None
        assert e.top_logprobs[0][0] == e.id  # greedy picks the most likely token
        assert abs(e.top_logprobs[0][1] - e.logprob) < 1e-5
    full = p + tuple(e.id for e in events)
    scored, _ = await run(engine, full, max_tokens=0, logprob_ranges=(PositionRange(n, n + 6),))
    assert [s.position for s in scored] == [e.position for e in events]
    for s, e in zip(scored, events, strict=True):
        assert s.id == e.id and s.top_logprobs is None
        assert abs(s.logprob - e.logprob) < LOGPROB_TOL


async def test_top_k_1_is_greedy_and_its_token_heads_its_own_top_logprobs(engine: Any) -> None:
    """At any temperature, top_k 1 decodes the greedy tokens, each the first entry of its top logprobs."""
    p = prompt(engine, "ties")
    n = len(p)
    logprobs: dict[str, Any] = {"logprob_ranges": (PositionRange(n, n + 8),), "logprob_top_k": 4}
    greedy, _ = await run(engine, p, max_tokens=8, ignore_eos=True, **logprobs)
    for seed in (1, 2):
        top1, _ = await run(engine, p, max_tokens=8, ignore_eos=True, temperature=1.0, top_k=1, seed=seed, **logprobs)
        assert decoded(top1) == decoded(greedy)
        for e in top1:
            assert e.top_logprobs is not None and e.top_logprobs[0][0] == e.id
            values = [(-v, i) for i, v in e.top_logprobs]
            assert values == sorted(values)  # most likely first, the lowest id first among equals


async def test_readouts_have_the_manifest_shape_and_match_between_paths(engine: Any) -> None:
    p = prompt(engine, "readouts")
    n = len(p)
    shape = engine.info.readouts.shape
    events, _ = await run(
        engine,
        p,
        max_tokens=4,
        ignore_eos=True,
        readout_ranges=(PositionRange(n - 3, n + 4),),
    )
    prefill = [e for e in events if e.is_prefill]
    assert [e.position for e in prefill] == [n - 3, n - 2, n - 1]
    assert all(e.logprob is None for e in prefill)
    for e in events:
        assert e.readout is not None and e.readout.shape == shape and e.readout.dtype == np.float32
        assert np.all(np.isfinite(e.readout))
    full = p + tuple(decoded(events))
    rescored, _ = await run(engine, full, max_tokens=0, readout_ranges=(PositionRange(n - 3, n + 4),))
    assert [e.position for e in rescored] == list(range(n - 3, n + 4))
    for a, b in zip(events, rescored, strict=True):
        assert np.allclose(a.readout, b.readout, atol=READOUT_TOL), (a.position, a.readout, b.readout)


async def test_session_turn_prefills_only_the_delta_and_equals_recompute(engine: Any) -> None:
    key = uuid.uuid4().hex
    turn1 = prompt(engine, "first turn of a conversation")
    out1, done1 = await run(engine, turn1, session=key, max_tokens=5, ignore_eos=True)
    assert done1.cached_tokens == 0 and done1.prefilled_tokens == len(turn1)
    history = turn1 + tuple(decoded(out1))
    turn2 = history + prompt(engine, "second")
    n2 = len(turn2)
    ranges = {"logprob_ranges": (PositionRange(n2, n2 + 5),), "logprob_top_k": 2}
    out2, done2 = await run(engine, turn2, session=key, max_tokens=5, ignore_eos=True, **ranges)
    # engines reuse whole cache blocks (vLLM: block_size tokens; the transformers engine: any length)
    block = getattr(engine, "cache_block_size", 1)
    reusable = (len(history) - 1) // block * block
    assert done2.cached_tokens >= reusable
    assert done2.prefilled_tokens <= n2 - reusable
    fresh, done_fresh = await run(engine, turn2, max_tokens=5, ignore_eos=True, **ranges)
    assert done_fresh.cached_tokens == 0
    assert decoded(out2) == decoded(fresh)
    for a, b in zip(out2, fresh, strict=True):
        assert abs(a.logprob - b.logprob) < LOGPROB_TOL


async def test_prefix_positions_asked_for_are_recomputed_not_missing(engine: Any) -> None:
    key = uuid.uuid4().hex
    t1 = prompt(engine, "cached prefix")
    out, _ = await run(engine, t1, session=key, max_tokens=3, ignore_eos=True)
    t2 = t1 + tuple(decoded(out)) + prompt(engine, "more")
    events, _ = await run(
        engine,
        t2,
        session=key,
        max_tokens=0,
        readout_ranges=(PositionRange(2, 5),),
        logprob_ranges=(PositionRange(2, 5),),
    )
    assert [e.position for e in events] == [2, 3, 4]
    assert all(e.readout is not None and e.logprob is not None for e in events)


async def test_release_forgets_a_session_cache(engine: Any) -> None:
    key = uuid.uuid4().hex
    t1 = prompt(engine, "to be released")
    await run(engine, t1, session=key, max_tokens=2, ignore_eos=True)
    engine.release(key)
    _, done = await run(engine, (*t1, 65, 66), session=key, max_tokens=1, ignore_eos=True)
    assert done.cached_tokens == 0


async def test_cancelling_the_consumer_stops_the_request(engine: Any) -> None:
    p = prompt(engine, "cancel me")
    request = EngineRequest(request_id=uuid.uuid4().hex, tokens=p, spec=GenerateSpec(max_tokens=400, ignore_eos=True))
    stream = engine.generate(request)
    got = 0
    async for _ in stream:
        got += 1
        if got == 3:
            break
    await stream.aclose()
    for _ in range(100):
        if engine.in_flight() == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.in_flight() == 0
    events, _ = await run(engine, p, max_tokens=2, ignore_eos=True)  # still serving
    assert len(events) == 2


async def test_concurrent_requests_equal_their_sequential_results(engine: Any) -> None:
    prompts = [prompt(engine, f"concurrent {i}") for i in range(4)]
    sequential = [decoded((await run(engine, p, max_tokens=6, ignore_eos=True))[0]) for p in prompts]
    results = await asyncio.gather(
        *(run(engine, p, session=uuid.uuid4().hex, max_tokens=6, ignore_eos=True) for p in prompts)
    )
    assert [decoded(ev) for ev, _ in results] == sequential
