"""Steering on the vLLM engine, on its compiled path: what the transformers engine computes,
per row in a batch, and never served from blocks computed under other steering.

vLLM runs with its default compilation (on CPU: Dynamo and Inductor), so the vectors are
added by the in-graph op. Tolerances are the cross-check's (:mod:`.test_vllm_crosscheck`).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from prismgate.core import checks
from prismgate.core.actions import PositionRange
from prismgate.core.errors import Code, GatewayError
from prismgate.core.steering import Comparison, Gate, Positions, SteeringEntry
from tests.engines.requests import run
from tests.engines.test_vllm_crosscheck import assert_compiled, compare, pair
from tests.engines.vllm_factory import require_vllm

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX = 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tiny_model_dir: Path, tiny_pack: Path) -> Any:
    hf, vl = await pair(tiny_model_dir, tiny_pack, "tiny-llama")
    yield hf, vl
    await vl.close()
    await hf.close()


def push(scale: float, *, layer: int = 0, concept: str = "concept1", **kw: Any) -> SteeringEntry:
    return SteeringEntry(layer=layer, scale=scale, concept=concept, **kw)


def raw(scale: float, *, layer: int = 1, **kw: Any) -> SteeringEntry:
    direction = tuple(float(x) for x in np.random.default_rng(7).standard_normal(128))
    return SteeringEntry(layer=layer, scale=scale, direction=direction, **kw)


MIXED = (
    push(6.0),
    push(0.5, layer=1, concept="concept2", norm_match=True, positions=Positions.GENERATED),
    raw(-4.0, positions=Positions.PROMPT),
    push(2.0),
)


def prompt(engine: Any, text: str, length: int = 0) -> tuple[int, ...]:
    ids = tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": text}]))
    return ids if len(ids) >= length else (ids * (length // len(ids) + 1))[:length]


def spec(p: tuple[int, ...], *steering: SteeringEntry, max_tokens: int = MAX) -> dict[str, Any]:
    n = len(p)
    return {
        "max_tokens": max_tokens, "ignore_eos": True, "logprob_top_k": 2,
        "logprob_ranges": (PositionRange(1, n + max_tokens),),
        "readout_ranges": (PositionRange(0, n + max_tokens),),
        "steering": steering,
    }  # fmt: skip


def ids(events: list[Any]) -> list[int]:
    return [e.id for e in events]


def same(a: list[Any], b: list[Any]) -> bool:
    """Bit for bit: ids, logprobs and readouts."""
    return [(e.position, e.id, e.logprob, e.top_logprobs) for e in a] == [
        (e.position, e.id, e.logprob, e.top_logprobs) for e in b
    ] and all(np.array_equal(x.readout, y.readout) for x, y in zip(a, b, strict=True))


async def test_vllm_steers_as_the_transformers_engine_does(engines: Any) -> None:
    hf, vl = engines
    p = prompt(hf, "steer both engines alike")
    plain, _ = await run(vl, p, **spec(p))
    for steering in ((push(8.0),), MIXED):
        hf_events, _ = await run(hf, p, **spec(p, *steering))
        vl_events, _ = await run(vl, p, **spec(p, *steering))
        assert_compiled(vl)
        worst = compare(hf_events, vl_events)  # same greedy tokens; logprobs and readouts within tolerance
        print("steered worst differences:", worst)
        assert ids(vl_events) != ids(plain)  # the steering changed the answer


async def test_scale_zero_and_an_unsteered_request_are_exactly_the_unsteered_run(engines: Any) -> None:
    _, vl = engines
    p = prompt(vl, "steer me nowhere")
    plain, _ = await run(vl, p, **spec(p))
    zero, _ = await run(vl, p, **spec(p, push(0.0), push(0.0, layer=1, norm_match=True)))
    assert same(plain, zero)


async def test_steered_and_unsteered_requests_batched_are_what_they_are_alone(engines: Any) -> None:
    _, vl = engines
    texts = ["a", "a longer question about prisms", "mid length", "the longest prompt of them all"]
    ps = [prompt(vl, t) for t in texts]
    steerings: list[tuple[SteeringEntry, ...]] = [(), (push(6.0),), (), MIXED]
    alone = [await run(vl, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)]
    mixed = await asyncio.gather(*(run(vl, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)))
    unsteered = await asyncio.gather(*(run(vl, p, **spec(p)) for p in ps))
    for (a, _), (m, _) in zip(alone, mixed, strict=True):
        assert ids(a) == ids(m)  # steered or not, batched is what alone is
        for x, y in zip(a, m, strict=True):
            assert np.allclose(x.readout, y.readout, atol=1e-4)
    for row in (0, 2):  # the same batch with and without neighbours that steer: bit for bit
        assert same(mixed[row][0], unsteered[row][0])
    assert ids(mixed[1][0]) != ids(unsteered[1][0])


async def test_the_prefix_cache_serves_only_blocks_computed_under_the_same_steering(engines: Any) -> None:
    _, vl = engines
    block = vl.cache_block_size
    key = uuid.uuid4().hex
    first = prompt(vl, "a long first turn about caches and steering", 3 * block)
    short = {"max_tokens": 4, "ignore_eos": True}
    both = (push(5.0),)
    events, done = await run(vl, first, key, **short, steering=both)
    assert done.cached_tokens == 0
    timeline = first + tuple(ids(events))
    second = timeline + prompt(vl, "and a second")
    events, done = await run(vl, second, key, **short, steering=both)  # same steering: the blocks serve
    assert done.cached_tokens == len(timeline) // block * block > 0
    third = second + tuple(ids(events))
    alone, _ = await run(vl, third, None, **short)  # what the unsteered turn must compute
    events, done = await run(vl, third, key, **short)  # unsteered: nothing of the steered blocks
    assert done.cached_tokens == 0 and done.prefilled_tokens == len(third)
    assert ids(events) == ids(alone)
    events, done = await run(vl, third, key, **short)  # unsteered again: its own blocks serve
    assert done.cached_tokens == (len(third) - 1) // block * block
    # prompt and generated steered differently: only the same prompt and spec may share blocks
    later = (push(5.0, positions=Positions.GENERATED),)
    events, done = await run(vl, third, key, **short, steering=later)
    assert done.cached_tokens == 0
    fourth = third + tuple(ids(events)) + prompt(vl, "more")
    fresh, _ = await run(vl, fourth, None, **short, steering=later)
    events, done = await run(vl, fourth, key, **short, steering=later)
    assert done.cached_tokens == 0 and ids(events) == ids(fresh)


async def test_session_values_are_not_reused_across_steering(engines: Any) -> None:
    """Readouts the engine stored for a session's earlier turn are only served under the same steering."""
    _, vl = engines
    key = uuid.uuid4().hex
    p = prompt(vl, "stored readouts and steering")
    n = len(p)
    ask = {"max_tokens": 2, "ignore_eos": True, "readout_ranges": (PositionRange(0, n),)}
    plain, _ = await run(vl, p, key, **ask)
    steered, _ = await run(vl, p, key, **ask, steering=(push(8.0, positions=Positions.PROMPT),))
    fresh, _ = await run(vl, p, None, **ask, steering=(push(8.0, positions=Positions.PROMPT),))
    assert all(np.array_equal(a.readout, b.readout) for a, b in zip(steered, fresh, strict=True))
    assert not np.allclose(steered[3].readout, plain[3].readout)


async def test_a_gated_entry_is_refused_not_ignored(engines: Any) -> None:
    hf, vl = engines
    gated = push(2.0, layer=1, gate=Gate("concept0", 0, Comparison.ABOVE, 0.0))
    assert hf.info.steering_gates and not vl.info.steering_gates
    with pytest.raises(GatewayError, match="the vllm engine does not support it yet") as caught:
        checks.check_steering(vl.info, (push(1.0), gated))
    assert caught.value.code is Code.INVALID_ARGUMENT
    # and the engine itself, should a request reach it unchecked
    p = prompt(vl, "gate me")
    message = "readout-gated steering runs on the transformers engine; the vLLM engine does not support it yet"
    with pytest.raises(GatewayError, match=message) as caught:
        await run(vl, p, **spec(p, push(1.0), gated))
    assert caught.value.code is Code.INVALID_ARGUMENT
    plain, _ = await run(vl, p, **spec(p))  # nothing was left half-submitted
    assert len(plain) == len(p) + MAX


@pytest.mark.slow
async def test_smollm2_steered_toward_french_agrees_with_transformers() -> None:
    require_vllm()
    from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
    from prismgate.engines.readouts.pack import DEFAULT_PACKS

    pack = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"
    hf, vl = await pair(default_model_path(), pack, DEFAULT_MODEL_ID)
    try:
        chat = [{"role": "user", "content": "Tell me about your favourite food."}]
        p = tuple(hf.info.tokenizer.render_chat(chat))
        n = len(p)
        ask: dict[str, Any] = {
            "max_tokens": 20,
            "logprob_ranges": (PositionRange(n - 8, n + 20),),
            "logprob_top_k": 3,
            "readout_ranges": (PositionRange(1, n + 20),),
        }
        plain, _ = await run(vl, p, **ask)
        french = (
            SteeringEntry(layer=12, scale=24.0, concept="french"),
            SteeringEntry(layer=16, scale=0.1, concept="french", norm_match=True, positions=Positions.GENERATED),
        )
        hf_events, _ = await run(hf, p, **ask, steering=french)
        vl_events, _ = await run(vl, p, **ask, steering=french)
        assert_compiled(vl)
        worst = compare(hf_events, vl_events)
        text = vl.info.tokenizer.decode(ids([e for e in vl_events if not e.is_prefill]))
        print("SmolLM2 steered worst differences:", worst, "answer:", text)
        assert ids(vl_events) != ids(plain)
    finally:
        await vl.close()
        await hf.close()
