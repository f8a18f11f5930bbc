"""Steering by SAE feature on the vLLM engine, compiled: what the transformers engine computes.

The tiny model (3 layers, hidden 128) with its concept pack (layers 0 and 1) and three random
SAEs of 256 features, one per architecture: TopK (k 6) after layer 0 and JumpReLU after layer 1
(pack layers too), standard (ReLU) after layer 2 (an SAE only, so steered by the SAE alone). Both
engines float32, vLLM with its default compilation: the same greedy tokens, logprobs and readouts
within the cross-check's tolerances (:mod:`.test_vllm_crosscheck`), and the features read after
the steering (top and watched) within the features test's (:mod:`.test_vllm_features`): a feature
with a scale, clamps at each SAE, gates on a feature at an earlier and at the same layer. Then the
rules the transformers engine keeps: a feature is its decoder row as a raw direction, bit for bit;
a row that asks nothing, and a clamp to the activation a row already has, are the unsteered run,
bit for bit; a feature-steered request batched is what it is alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from prismgate.core.actions import PositionRange
from prismgate.core.features import FeatureSpec
from prismgate.core.steering import Comparison, Gate, Positions, SteeringEntry
from prismgate.engines.sae.files import load_sae
from tests.engines.requests import run
from tests.engines.test_vllm_crosscheck import assert_compiled, compare
from tests.engines.test_vllm_steering import ids, moved, prompt, same
from tests.engines.vllm_factory import make_vllm_engine, require_vllm
from tests.sae.saes import write_sae

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

MAX = 10
LAYERS = (0, 1, 2)
WATCH = tuple(range(256))  # every feature of each SAE: the tests pick theirs from a plain run
RTOL = 1e-3  # activations, as tests/engines/test_vllm_features.py
TEXT = "a prompt long enough that a feature gate opens at some of its positions and stays shut at others"


@pytest.fixture(scope="module")
def saes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("vllm-steer-saes")
    return [
        write_sae(root / "topk0", "topk", layer=0, k=6, seed=21),
        write_sae(root / "jumprelu1", "jumprelu", layer=1, seed=22),
        write_sae(root / "standard2", "standard", layer=2, seed=23),
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tiny_model_dir: Path, tiny_pack: Path, saes: list[Path]) -> Any:
    require_vllm()
    from prismgate.engines.hf import TransformersEngine

    specs = tuple((folder, None) for folder in saes)
    hf = TransformersEngine(
        tiny_model_dir, model_id="tiny-llama", concept_pack=tiny_pack, threads=1, dtype="float32", saes=specs
    )
    vl = make_vllm_engine(tiny_model_dir, concept_pack=tiny_pack, saes=specs)
    await hf.start()
    await vl.start()
    yield hf, vl
    await vl.close()
    await hf.close()


def spec(p: tuple[int, ...], *steering: SteeringEntry, watch: tuple[int, ...] = (), top_k: int = 4) -> dict[str, Any]:
    n = len(p)
    whole = (PositionRange(0, n + MAX),)
    return {
        "max_tokens": MAX, "ignore_eos": True, "logprob_top_k": 2,
        "logprob_ranges": (PositionRange(1, n + MAX),), "readout_ranges": whole,
        "features": FeatureSpec(top_k=top_k, layers=LAYERS, ids=watch, ranges=whole),
        "steering": steering,
    }  # fmt: skip


def close(got: float, want: float) -> bool:
    return abs(got - want) <= RTOL * max(1.0, abs(want))


def compare_features(hf_events: list[Any], vl_events: list[Any]) -> float:
    """The features read after the steering: top values in order, ids equal but for near-ties, watched ids."""
    worst = 0.0
    for a, b in zip(hf_events, vl_events, strict=True):
        fa, fb = a.features, b.features
        for layer in range(len(LAYERS)):
            want, got = fa.values[layer].tolist(), fb.values[layer].tolist()
            assert len(want) == len(got), (a.position, layer)
            for j, (va, vb) in enumerate(zip(want, got, strict=True)):
                assert close(vb, va), (a.position, layer, va, vb)
                worst = max(worst, abs(va - vb))
                if fa.ids[layer][j] != fb.ids[layer][j]:  # only where the reference has a near-tie there
                    others = [v for i, v in enumerate(want) if i != j]
                    assert j == len(want) - 1 or any(close(v, va) for v in others), (a.position, layer, j)
        if fa.watched is not None:
            assert fb.watched is not None
            scale = np.maximum(1.0, np.abs(fa.watched))
            assert np.all(np.abs(fa.watched - fb.watched) <= RTOL * scale), a.position
    return worst


def gap(values: np.ndarray) -> float:
    """The middle of the widest gap between sorted ``values``: a threshold far from every one of them."""
    v = np.sort(values)
    k = int(np.argmax(np.diff(v)))
    return float(v[k] + v[k + 1]) / 2


def watched(events: list[Any], layer: int) -> np.ndarray:
    """``[positions, features]``: every watched feature's activation at one SAE layer, position by position."""
    return np.stack([e.features.watched[LAYERS.index(layer)] for e in events])


def lively(acts: np.ndarray, upto: int, exclude: tuple[int, ...] = ()) -> int:
    """A feature active at some of the first ``upto`` positions and not at others (the most distinct values)."""
    part = acts[:upto]
    active = (part > 0).sum(axis=0)
    distinct = [len(set(part[:, f].tolist())) if 0 < active[f] < upto else 0 for f in range(part.shape[1])]
    for f in exclude:
        distinct[f] = 0
    return int(np.argmax(distinct))


async def both(engines: Any, p: tuple[int, ...], *steering: SteeringEntry, **kw: Any) -> tuple[list[Any], list[Any]]:
    hf, vl = engines
    hf_events, _ = await run(hf, p, **spec(p, *steering, **kw))
    vl_events, _ = await run(vl, p, **spec(p, *steering, **kw))
    assert_compiled(vl)
    return hf_events, vl_events


async def test_features_with_a_scale_steer_as_the_transformers_engine_does(engines: Any) -> None:
    _, vl = engines
    p = prompt(vl, "steer by a feature's decoder row")
    plain, _ = await run(vl, p, **spec(p))
    for steering in (
        (SteeringEntry(layer=0, scale=8.0, feature=17),),
        (
            SteeringEntry(layer=2, scale=6.0, feature=40),  # the SAE's layer alone: no pack there
            SteeringEntry(layer=1, scale=0.3, feature=5, norm_match=True, positions=Positions.GENERATED),
            SteeringEntry(layer=1, scale=2.0, concept="concept2"),
        ),
    ):
        hf_events, vl_events = await both(engines, p, *steering)
        worst = compare(hf_events, vl_events)
        print("feature with a scale, worst differences:", worst, "features", compare_features(hf_events, vl_events))
        assert not same(plain, vl_events)
    first, _ = await run(vl, p, **spec(p, SteeringEntry(layer=0, scale=8.0, feature=17)))
    assert ids(first) != ids(plain)  # it changed the answer


async def test_clamps_set_activations_as_the_transformers_engine_does(engines: Any) -> None:
    """A clamp at each SAE (each architecture), one after a concept vector at the same layer."""
    _, vl = engines
    p = prompt(vl, "clamp the features of every SAE")
    plain, _ = await run(vl, p, **spec(p, watch=WATCH))
    picks = {layer: lively(watched(plain, layer), len(plain)) for layer in LAYERS}
    print("clamped features:", picks)
    for steering in (
        (SteeringEntry(layer=0, scale=0.0, feature=picks[0], clamp=12.0),),
        (
            SteeringEntry(layer=1, scale=4.0, concept="concept1"),
            SteeringEntry(layer=1, scale=0.0, feature=picks[1], clamp=0.0),  # the stream the concept left
            SteeringEntry(layer=2, scale=0.0, feature=picks[2], clamp=6.0, positions=Positions.GENERATED),
        ),
    ):
        hf_events, vl_events = await both(engines, p, *steering, watch=tuple(picks.values()))
        worst = compare(hf_events, vl_events)
        print("clamped, worst differences:", worst, "features", compare_features(hf_events, vl_events))
        assert not same(plain, vl_events)


async def test_feature_gates_open_where_the_transformers_engines_do(engines: Any) -> None:
    """A concept vector at layer 1 gated on a TopK feature of layer 0, opening exactly where that feature's
    activation one position earlier passes; and a clamp gated on a feature of its own layer."""
    _, vl = engines
    p = prompt(vl, TEXT)
    n = len(p)
    plain, _ = await run(vl, p, **spec(p, watch=WATCH))
    acts = watched(plain, 0)
    g = lively(acts, n)
    threshold = gap(acts[:n, g])
    for comparison in Comparison:
        entry = SteeringEntry(
            layer=1, scale=8.0, concept="concept1", gate=Gate(None, 0, comparison, threshold, feature=g)
        )
        hf_events, vl_events = await both(engines, p, entry, watch=(g,))
        worst = compare(hf_events, vl_events)
        print(f"gated on feature {g} {comparison.value}: worst differences {worst}")
        compare_features(hf_events, vl_events)
        # layer 0 is steered by nobody: over the prompt the gate compares the plain run's activations
        above = comparison is Comparison.ABOVE
        expected = [q for q in range(1, n) if (acts[q - 1, g] > threshold if above else acts[q - 1, g] < threshold)]
        assert 0 < len(expected) < n - 1
        assert moved(plain, vl_events, n) == expected
    # a gate at the clamp's own layer reads that layer before its vectors: over the prompt, the plain run's
    same_layer = watched(plain, 1)
    g1 = lively(same_layer, n)
    gate = Gate(None, 1, Comparison.ABOVE, gap(same_layer[:n, g1]), feature=g1)
    clamp = SteeringEntry(layer=1, scale=0.0, feature=lively(same_layer, n, (g1,)), clamp=9.0, gate=gate)
    hf_events, vl_events = await both(engines, p, clamp, watch=(g1,))
    compare(hf_events, vl_events)
    compare_features(hf_events, vl_events)
    opened = [q for q in range(1, n) if same_layer[q - 1, g1] > gate.threshold]
    changed = [
        e.position for a, e in zip(plain[:n], vl_events[:n], strict=True) if not np.array_equal(a.readout, e.readout)
    ]
    assert changed == opened and 0 < len(opened) < n - 1


async def test_a_feature_is_its_decoder_row_as_a_raw_direction_bit_for_bit(engines: Any, saes: list[Path]) -> None:
    _, vl = engines
    p = prompt(vl, "a feature or its decoder row")
    row = tuple(float(v) for v in load_sae(saes[2]).W_dec[40])
    by_feature, _ = await run(vl, p, **spec(p, SteeringEntry(layer=2, scale=6.0, feature=40)))
    by_row, _ = await run(vl, p, **spec(p, SteeringEntry(layer=2, scale=6.0, direction=row)))
    assert same(by_feature, by_row)


async def test_rows_that_ask_nothing_and_clamps_that_move_nothing_are_the_unsteered_run(engines: Any) -> None:
    _, vl = engines
    texts = ["a", "a longer question about prisms", "mid length", TEXT]
    ps = [prompt(vl, t) for t in texts]
    plain, _ = await run(vl, ps[0], **spec(ps[0], watch=WATCH))
    silent = int(np.flatnonzero((watched(plain, 0) == 0).all(axis=0))[0])  # inactive at every position
    nothing, _ = await run(vl, ps[0], **spec(ps[0], SteeringEntry(layer=0, scale=0.0, feature=silent, clamp=0.0)))
    assert same(nothing, (await run(vl, ps[0], **spec(ps[0])))[0])
    steerings: list[tuple[SteeringEntry, ...]] = [
        (),
        (SteeringEntry(layer=2, scale=6.0, feature=40),),
        (
            SteeringEntry(layer=0, scale=0.0, feature=7, clamp=10.0),
            SteeringEntry(layer=2, scale=0.0, feature=9, clamp=3.0),
        ),
        (SteeringEntry(layer=1, scale=8.0, concept="concept1", gate=Gate(None, 0, Comparison.ABOVE, 0.5, feature=7)),),
    ]
    alone = [await run(vl, x, **spec(x, *s)) for x, s in zip(ps, steerings, strict=True)]
    mixed = await asyncio.gather(*(run(vl, x, **spec(x, *s)) for x, s in zip(ps, steerings, strict=True)))
    unsteered = await asyncio.gather(*(run(vl, x, **spec(x)) for x in ps))
    for (a, _), (m, _) in zip(alone, mixed, strict=True):
        assert ids(a) == ids(m)  # steered or not, batched is what alone is
        for x, y in zip(a, m, strict=True):
            assert np.allclose(x.readout, y.readout, atol=1e-4)
    assert same(mixed[0][0], unsteered[0][0])  # beside three feature-steered neighbours: bit for bit


async def test_a_model_served_with_saes_and_no_pack_steers_by_feature(tiny_model_dir: Path, saes: list[Path]) -> None:
    """No concept pack: the SAEs' layers alone steer (a feature, a clamp, a gate on a feature), as transformers does."""
    from prismgate.core.checks import check_steering
    from prismgate.core.errors import GatewayError
    from prismgate.engines.hf import TransformersEngine

    specs = tuple((folder, None) for folder in saes[1:])  # after layers 1 and 2
    hf = TransformersEngine(tiny_model_dir, model_id="tiny-llama", threads=1, dtype="float32", saes=specs)
    vl = make_vllm_engine(tiny_model_dir, saes=specs)
    await hf.start()
    await vl.start()
    try:
        assert vl.info.readouts is None and vl.info.steering and vl.info.steering_features
        p = prompt(vl, "no pack, only sparse autoencoders")
        n = len(p)
        steering = (
            SteeringEntry(layer=1, scale=5.0, feature=12),
            SteeringEntry(
                layer=2, scale=0.0, feature=30, clamp=4.0, gate=Gate(None, 1, Comparison.ABOVE, 0.1, feature=12)
            ),
        )
        whole = (PositionRange(0, n + MAX),)
        ask: dict[str, Any] = {
            "max_tokens": MAX, "ignore_eos": True, "logprob_top_k": 2, "logprob_ranges": (PositionRange(1, n + MAX),),
            "features": FeatureSpec(top_k=4, layers=(1, 2), ids=(12, 30), ranges=whole), "steering": steering,
        }  # fmt: skip
        hf_events, _ = await run(hf, p, **ask)
        vl_events, _ = await run(vl, p, **ask)
        plain, _ = await run(vl, p, **{**ask, "steering": ()})
        compare(hf_events, vl_events)
        for a, b in zip(hf_events, vl_events, strict=True):
            scale = np.maximum(1.0, np.abs(a.features.watched))
            assert np.all(np.abs(a.features.watched - b.features.watched) <= RTOL * scale), a.position
        assert ids(vl_events) != ids(plain) or any(
            not np.array_equal(a.features.watched, b.features.watched) for a, b in zip(plain, vl_events, strict=True)
        )
        with pytest.raises(GatewayError, match="no concept pack"):  # a concept needs a pack, here as on transformers
            check_steering(vl.info, (SteeringEntry(layer=1, scale=1.0, concept="concept0"),))
    finally:
        await vl.close()
        await hf.close()
