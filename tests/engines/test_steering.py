"""Steering in the transformers engine: exact where it must be, per row in a batch, cache-safe."""

from __future__ import annotations

import asyncio
import copy
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest_asyncio
import torch

from prismgate.core.actions import PositionRange
from prismgate.core.steering import Positions, SteeringEntry
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.hf.loading import load
from prismgate.engines.hf.steering import RowPlan
from tests.engines.requests import run

MAX = 12


@pytest_asyncio.fixture
async def engine(tiny_model_dir: Path, tiny_pack: Path) -> Any:
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, prefill_chunk=16)
    await eng.start()
    yield eng
    await eng.close()


def prompt(engine: Any, text: str) -> tuple[int, ...]:
    return tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": text}]))


def spec(p: tuple[int, ...], *steering: SteeringEntry) -> dict[str, Any]:
    n = len(p)
    return {
        "max_tokens": MAX, "ignore_eos": True, "logprob_top_k": 2,
        "logprob_ranges": (PositionRange(1, n + MAX),), "readout_ranges": (PositionRange(1, n + MAX),),
        "steering": steering,
    }  # fmt: skip


def push(scale: float, *, layer: int = 0, concept: str = "concept1", **kw: Any) -> SteeringEntry:
    return SteeringEntry(layer=layer, scale=scale, concept=concept, **kw)


def same(a: list[Any], b: list[Any]) -> bool:
    """Bit for bit: ids, logprobs and readouts."""
    return [(e.position, e.id, e.logprob, e.top_logprobs) for e in a] == [
        (e.position, e.id, e.logprob, e.top_logprobs) for e in b
    ] and all(np.array_equal(x.readout, y.readout) for x, y in zip(a, b, strict=True))


async def test_scale_zero_is_exactly_unsteered(engine: Any) -> None:
    p = prompt(engine, "steer me nowhere")
    plain, _ = await run(engine, p, **spec(p))
    for entry in (push(0.0), push(0.0, norm_match=True), SteeringEntry(layer=1, scale=0.0, direction=(1.0,) * 128)):
        steered, _ = await run(engine, p, **spec(p, entry))
        assert same(plain, steered)


async def test_steering_moves_the_readout_along_its_direction_at_its_layer_and_later(engine: Any) -> None:
    p = prompt(engine, "steer me toward concept one")
    n = len(p)
    plain, _ = await run(engine, p, **spec(p))
    steered, _ = await run(engine, p, **spec(p, push(8.0, layer=0, positions=Positions.PROMPT)))
    before = np.stack([e.readout for e in plain if e.position < n])
    after = np.stack([e.readout for e in steered if e.position < n])
    # layer 0 (index 0), concept 1: the readout is the dot product with the unit vector added
    assert np.allclose(after[:, 0, 1] - before[:, 0, 1], 8.0, atol=1e-3)
    assert not np.allclose(after[:, 1], before[:, 1])  # layer 1 sees the steered stream
    # two vectors at one layer add up, in order
    twice, _ = await run(engine, p, **spec(p, push(3.0, positions=Positions.PROMPT), push(5.0)))
    summed = np.stack([e.readout for e in twice if e.position < n])
    assert np.allclose(summed[:, 0, 1] - before[:, 0, 1], 8.0, atol=1e-3)


async def test_norm_matched_steering_scales_with_the_hidden_state(engine: Any) -> None:
    p = prompt(engine, "norm matched")
    n = len(p)
    plain, _ = await run(engine, p, **spec(p))
    steered, _ = await run(engine, p, **spec(p, push(0.5, norm_match=True)))
    moved = [s.readout[0, 1] - a.readout[0, 1] for a, s in zip(plain, steered, strict=True) if 1 <= a.position < n]
    assert all(m > 0 for m in moved) and len({round(float(m), 3) for m in moved}) > 1  # in proportion to each norm


async def test_a_batch_steers_each_row_as_asked_and_each_answer_is_what_it_is_alone(engine: Any) -> None:
    texts = ["a", "a longer question about prisms", "mid length", "the longest prompt of them all"]
    ps = [prompt(engine, t) for t in texts]
    steerings: list[tuple[SteeringEntry, ...]] = [
        (),
        (push(6.0),),
        (),
        (push(-4.0, layer=1, concept="concept2"), push(0.5, layer=1, norm_match=True), push(2.0)),
    ]
    alone = [await run(engine, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)]
    before = engine.stats["batched_steps"]
    mixed = await asyncio.gather(*(run(engine, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)))
    assert engine.stats["batched_steps"] - before > 5
    unsteered_batch = await asyncio.gather(*(run(engine, p, **spec(p)) for p in ps))
    for (a, _), (m, _) in zip(alone, mixed, strict=True):
        assert [e.id for e in a] == [e.id for e in m]  # steered or not, batched is what alone is
        for x, y in zip(a, m, strict=True):
            assert np.allclose(x.readout, y.readout, atol=1e-4)
    assert [e.id for e in mixed[1][0]] != [e.id for e in unsteered_batch[1][0]]


def test_in_one_batched_step_unsteered_rows_are_bit_for_bit_unchanged(tiny_model_dir: Path, tiny_pack: Path) -> None:
    """The same decode step (same caches, same padding) with and without neighbours that steer."""
    loaded = load(
        tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, device="cpu", dtype="auto", max_model_len=None
    )
    adapter, steerer, probe = loaded.adapter, loaded.steerer, loaded.probe
    assert steerer is not None and probe is not None
    vectors = steerer.resolve((push(6.0), push(0.5, layer=1, norm_match=True)))
    with torch.inference_mode():
        caches = []
        for length in (9, 17, 12, 30):
            cache = adapter.new_cache()
            adapter.forward(list(range(40, 40 + length)), cache, 0, [], [], [0])
            caches.append(cache)
        positions = [cache.get_seq_length() for cache in caches]

        def step(steered_rows: set[int]) -> tuple[torch.Tensor, np.ndarray]:
            snapshot = [copy.deepcopy(cache) for cache in caches]
            rows = [RowPlan(r, positions[r], 1, 4, vectors if r in steered_rows else ()) for r in range(4)]
            probe.enabled = True
            with steerer.plan(rows):
                logits = adapter.decode_batch([50, 51, 52, 53], snapshot, positions)
            return logits, probe.take_batch()

        plain_logits, plain_readouts = step(set())
        logits, readouts = step({1, 3})
    for row in (0, 2):
        assert torch.equal(logits[row], plain_logits[row])
        assert np.array_equal(readouts[row], plain_readouts[row])
    for row in (1, 3):
        assert not torch.equal(logits[row], plain_logits[row])


async def test_a_session_reuses_only_what_was_computed_under_the_same_steering(engine: Any) -> None:
    key = uuid.uuid4().hex
    p = prompt(engine, "first turn")
    n = len(p)
    short = {"max_tokens": 4, "ignore_eos": True}
    events, done = await run(engine, p, key, **short, steering=(push(5.0),))
    assert done.cached_tokens == 0 and done.prefilled_tokens == n
    timeline = p + tuple(e.id for e in events)
    p2 = timeline + prompt(engine, "second turn")
    # unsteered now: nothing computed under the steering may be reused
    _, done = await run(engine, p2, key, **short)
    assert done.cached_tokens == 0 and done.prefilled_tokens == len(p2)
    # unsteered again: everything but the last prompt token comes from the cache
    events, done = await run(engine, p2, key, **short)
    assert done.cached_tokens == len(p2) - 1 and done.prefilled_tokens == 1
    # steering only the generated tokens: the prompt's unsteered keys and values still serve
    events, done = await run(engine, p2, key, **short, steering=(push(5.0, positions=Positions.GENERATED),))
    assert done.cached_tokens == len(p2) - 1 and done.prefilled_tokens == 1
    # the cache now holds generated positions computed under the steering: the same tokens,
    # sent back unsteered as prompt, are recomputed
    p3 = p2 + tuple(e.id for e in events) + (1,)
    _, done = await run(engine, p3, key, **short)
    assert done.cached_tokens == len(p2) and done.prefilled_tokens == len(p3) - len(p2)
