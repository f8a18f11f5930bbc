"""Readout-gated steering in the transformers engine, checked against readouts computed without it.

The tiny model's pack reads layers 0 and 1. A vector added after layer 1 cannot change what
layer 0 or layer 1 compute at any prompt position (the stream after a layer depends on the
layers below it), so the gate readouts of a prompt are exactly the unsteered readouts, and the
layer-1 readout shows where the vector went in: exactly the unsteered value where the gate was
closed, about ``scale`` more where it was open.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest_asyncio

from prismgate.core.actions import PositionRange
from prismgate.core.steering import Comparison, Gate, Positions, SteeringEntry
from prismgate.engines.hf import TransformersEngine
from tests.engines.requests import run

MAX = 12
SCALE = 8.0
TEXT = "a prompt long enough to run as several prefill chunks, so the gate crosses chunk boundaries"


@pytest_asyncio.fixture
async def engine(tiny_model_dir: Path, tiny_pack: Path) -> Any:
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, prefill_chunk=16)
    await eng.start()
    yield eng
    await eng.close()


def prompt(engine: Any, text: str = TEXT) -> tuple[int, ...]:
    return tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": text}]))


def spec(p: tuple[int, ...], *steering: SteeringEntry, max_tokens: int = MAX) -> dict[str, Any]:
    n = len(p)
    return {
        "max_tokens": max_tokens, "ignore_eos": True, "logprob_top_k": 2,
        "logprob_ranges": (PositionRange(1, n + max_tokens),), "readout_ranges": (PositionRange(0, n + max_tokens),),
        "steering": steering,
    }  # fmt: skip


def tail(p: tuple[int, ...], *steering: SteeringEntry) -> dict[str, Any]:
    """Six tokens with logprobs and readouts of what is generated only (so the prompt may come from a cache)."""
    n = len(p)
    ranges = (PositionRange(n, n + 6),)
    return {
        "max_tokens": 6,
        "ignore_eos": True,
        "logprob_ranges": ranges,
        "readout_ranges": ranges,
        "steering": steering,
    }


def gated(threshold: float, comparison: Comparison = Comparison.ABOVE, *, layer: int = 0, **kw: Any) -> SteeringEntry:
    gate = Gate(concept="concept0", layer=layer, comparison=comparison, threshold=threshold)
    return SteeringEntry(layer=1, scale=SCALE, concept="concept1", gate=gate, **kw)


def same(a: list[Any], b: list[Any]) -> bool:
    """Bit for bit: ids, logprobs and readouts."""
    return [(e.position, e.id, e.logprob, e.top_logprobs) for e in a] == [
        (e.position, e.id, e.logprob, e.top_logprobs) for e in b
    ] and all(np.array_equal(x.readout, y.readout) for x, y in zip(a, b, strict=True))


def close(a: list[Any], b: list[Any]) -> bool:
    """The same tokens, readouts and logprobs to float32 noise (a cache computed step by step vs in one pass)."""
    return [(e.position, e.id) for e in a] == [(e.position, e.id) for e in b] and all(
        np.allclose(x.readout, y.readout, atol=1e-4) and abs(x.logprob - y.logprob) < 1e-4
        for x, y in zip(a, b, strict=True)
    )


def steered_positions(plain: list[Any], steered: list[Any], upto: int) -> list[int]:
    """Positions below ``upto`` whose layer-1 ``concept1`` readout moved (by about the scale)."""
    moved = []
    for a, s in zip(plain, steered, strict=True):
        if a.position >= upto:
            break
        delta = float(s.readout[1, 1] - a.readout[1, 1])
        assert delta == 0.0 or abs(delta - SCALE) < 1e-2, (a.position, delta)
        if delta:
            moved.append(a.position)
    return moved


async def test_a_gate_that_never_opens_is_exactly_unsteered(engine: Any) -> None:
    p = prompt(engine)
    plain, _ = await run(engine, p, **spec(p))
    for entry in (gated(1e30), gated(-1e30, Comparison.BELOW), gated(1e30, layer=1)):
        events, _ = await run(engine, p, **spec(p, entry))
        assert same(plain, events)


async def test_a_gate_that_always_opens_is_exactly_the_ungated_entry(engine: Any) -> None:
    # generated positions all have a previous position, so an always-open gate lets every one in
    p = prompt(engine)
    entry = gated(-1e30, positions=Positions.GENERATED)
    ungated, _ = await run(engine, p, **spec(p, replace(entry, gate=None)))
    plain, _ = await run(engine, p, **spec(p))
    events, _ = await run(engine, p, **spec(p, entry))
    assert same(ungated, events) and not same(plain, events)
    # over the prompt too: everything but position 0, which has no previous position
    both, _ = await run(engine, p, **spec(p, gated(1e30, Comparison.BELOW)))
    assert steered_positions(plain, both, len(p)) == list(range(1, len(p)))


async def test_a_gate_in_between_steers_where_the_previous_readout_passes(engine: Any) -> None:
    p = prompt(engine)
    n = len(p)
    assert n > 40  # several prefill chunks of 16
    plain, _ = await run(engine, p, **spec(p))
    for layer in (0, 1):
        values = [float(e.readout[layer, 0]) for e in plain]
        threshold = float(np.median(values[:n]))
        for comparison in Comparison:
            events, _ = await run(engine, p, **spec(p, gated(threshold, comparison, layer=layer)))

            def passes(v: float, threshold: float = threshold, comparison: Comparison = comparison) -> bool:
                return v > threshold if comparison is Comparison.ABOVE else v < threshold

            # the prompt: the gate readouts are the unsteered readouts, position by position
            expected = [q for q in range(1, n) if passes(values[q - 1])]
            assert 0 < len(expected) < n - 1
            assert steered_positions(plain, events, n) == expected
            # the generated positions (each decode step carries the last readout to the next): the
            # run's own timeline prefilled unsteered gives their layer-1 readouts without the vector
            # and their gate readouts (computed in one pass, not step by step: close, not bit-equal)
            timeline = tuple(e.id for e in events)
            again, _ = await run(engine, timeline, **{**spec(timeline), "max_tokens": 0})
            gates = [float(e.readout[layer, 0]) for e in again]
            for e, a in zip(events[n:], again[n:], strict=True):
                delta = float(e.readout[1, 1] - a.readout[1, 1])
                assert abs(delta - (SCALE if passes(gates[e.position - 1]) else 0.0)) < 1e-3, (e.position, delta)


async def test_gated_requests_batched_are_what_they_are_alone(engine: Any) -> None:
    ps = [prompt(engine, t) for t in ("a", "a longer question about prisms", "mid length", TEXT)]
    steerings: list[tuple[SteeringEntry, ...]] = [
        (gated(0.0),),
        (),
        (gated(0.0, Comparison.BELOW, layer=1), gated(0.0)),
        (gated(0.0, positions=Positions.GENERATED), SteeringEntry(layer=0, scale=2.0, concept="concept2")),
    ]
    alone = [await run(engine, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)]
    before = engine.stats["batched_steps"]
    mixed = await asyncio.gather(*(run(engine, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)))
    assert engine.stats["batched_steps"] - before > 5
    for (a, _), (m, _) in zip(alone, mixed, strict=True):
        assert [e.id for e in a] == [e.id for e in m]
        for x, y in zip(a, m, strict=True):
            assert np.allclose(x.readout, y.readout, atol=1e-4)


async def test_a_session_turn_reuses_its_cache_with_the_gate_readouts_kept_beside_it(engine: Any) -> None:
    key = uuid.uuid4().hex
    p = prompt(engine)
    entry = gated(0.0)
    short = {"max_tokens": 6, "ignore_eos": True}
    events, done = await run(engine, p, key, **short, steering=(entry,))
    assert done.cached_tokens == 0
    p2 = p + tuple(e.id for e in events) + prompt(engine, "second turn")
    # the same gated steering: the cache serves, and the answer is a fresh request's
    events, done = await run(engine, p2, key, **tail(p2, entry))
    fresh, _ = await run(engine, p2, **tail(p2, entry))
    assert done.cached_tokens > len(p) and close(fresh, events)
    # a cache computed under generated-only steering agrees on the unsteered prompt, but holds
    # no gate readouts of it: a gated turn runs from position 0
    other = uuid.uuid4().hex
    gen_only = replace(entry, positions=Positions.GENERATED)
    await run(engine, p, other, **short, steering=(replace(gen_only, gate=None),))
    _, done = await run(engine, p, other, **short, steering=(gen_only,))
    assert done.cached_tokens == 0 and done.prefilled_tokens == len(p)
    # now it holds them: the next gated turn is served from the cache, and is a fresh request's
    events, done = await run(engine, p, other, **tail(p, gen_only))
    fresh, _ = await run(engine, p, **tail(p, gen_only))
    assert done.cached_tokens > 0 and close(fresh, events)
