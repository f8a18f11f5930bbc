"""Steering by SAE feature in the transformers engine, checked against computations made without it.

The tiny model (3 layers, hidden 128) with its pack (layers 0 and 1) and two random TopK SAEs:
after layer 1 (a pack layer too) and after layer 2 (an SAE only). The checks:

* a feature with a scale is its decoder row sent as a raw direction, bit for bit;
* a clamp is ``h + (clamp - a(h)) * W_dec[f]`` at each covered position: a plain transformers
  forward pass with that arithmetic written out in a hook (and the encoder written out in
  torch from the safetensors file) gives the features the engine reports after it; and with an
  SAE whose encoder inverts its decoder (orthonormal rows), the clamped feature reads back as its
  target (on a model served with that SAE and no concept pack);
* a gate on a feature opens exactly where that feature's activation one position earlier passes;
* rows that ask nothing are untouched, a steered request's answer is the same alone or batched,
  and a session's cache serves a turn only under the same steering.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from prismgate.core.actions import PositionRange
from prismgate.core.features import FeatureSpec
from prismgate.core.steering import Comparison, Gate, Positions, SteeringEntry
from prismgate.engines.hf import TransformersEngine
from tests.engines.requests import run
from tests.sae.saes import write_sae

MAX = 8
TEXT = "a prompt long enough to run as several prefill chunks, so steering crosses chunk boundaries"


@pytest.fixture(scope="module")
def saes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("steer-saes")
    return [write_sae(root / "l1", layer=1, k=6, seed=11), write_sae(root / "l2", layer=2, k=6, seed=12)]


@pytest_asyncio.fixture
async def engine(tiny_model_dir: Path, tiny_pack: Path, saes: list[Path]) -> Any:
    eng = TransformersEngine(
        tiny_model_dir,
        model_id="tiny",
        concept_pack=tiny_pack,
        threads=1,
        prefill_chunk=16,
        saes=tuple((s, None) for s in saes),
    )
    await eng.start()
    yield eng
    await eng.close()


def prompt(engine: Any, text: str = TEXT) -> tuple[int, ...]:
    return tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": text}]))


def spec(p: tuple[int, ...], *steering: SteeringEntry, watch: tuple[int, ...] = (0,), **kw: Any) -> dict[str, Any]:
    """Every position's logprobs, readouts and (layers 1 and 2) top features and ``watch``ed ones."""
    end = len(p) + kw.get("max_tokens", MAX)
    every = (PositionRange(0, end),)
    features = FeatureSpec(top_k=4, layers=(1, 2), ids=watch, ranges=every)
    return {
        "max_tokens": MAX, "ignore_eos": True, "logprob_top_k": 2, "logprob_ranges": (PositionRange(1, end),),
        "readout_ranges": every, "features": features, "steering": steering, **kw,
    }  # fmt: skip


def same(a: list[Any], b: list[Any]) -> bool:
    """Bit for bit: ids, logprobs, readouts and features."""
    if [(e.position, e.id, e.logprob, e.top_logprobs) for e in a] != [
        (e.position, e.id, e.logprob, e.top_logprobs) for e in b
    ]:
        return False
    for x, y in zip(a, b, strict=True):
        if not np.array_equal(x.readout, y.readout) or not np.array_equal(x.features.watched, y.features.watched):
            return False
        if not all(np.array_equal(i, j) for i, j in zip(x.features.values, y.features.values, strict=True)):
            return False
    return True


def decoder(folder: Path) -> torch.Tensor:
    return load_file(str(folder / "sae_weights.safetensors"))["W_dec"].to(torch.float32)


async def test_a_feature_with_a_scale_is_its_unit_decoder_row_as_a_direction(engine: Any, saes: list[Path]) -> None:
    p = prompt(engine)
    plain, _ = await run(engine, p, **spec(p))
    for layer, folder in zip((1, 2), saes, strict=True):
        row = decoder(folder)[37].tolist()
        by_feature, _ = await run(engine, p, **spec(p, SteeringEntry(layer=layer, scale=6.0, feature=37)))
        by_direction, _ = await run(engine, p, **spec(p, SteeringEntry(layer=layer, scale=6.0, direction=tuple(row))))
        assert same(by_feature, by_direction) and not same(plain, by_feature)


def encode(folder: Path, x: torch.Tensor) -> torch.Tensor:
    """SAELens's TopK encoder, written out here from the file: ``[tokens, d_sae]``."""
    w = load_file(str(folder / "sae_weights.safetensors"))
    pre = (x.to(torch.float32) - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    values, ids = torch.topk(pre, 6, dim=-1)
    return torch.zeros_like(pre).scatter_(-1, ids, values.relu())


def clamped_pass(model_dir: Path, folder: Path, layer: int, feature: int, target: float, tokens: list[int]) -> Any:
    """The stream after each layer (``{layer: [tokens, hidden]}``) of one plain forward pass, with the
    clamp applied by a hook written here (the last layer's output is read before the final norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    row = decoder(folder)[feature]
    seen: dict[int, torch.Tensor] = {}

    def clamp(_module: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        h = hidden[0].to(torch.float32)
        activation = encode(folder, h)[:, feature : feature + 1]
        hidden[0] = (h + (target - activation) * row).to(hidden.dtype)

    def keep(index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            seen[index] = (output[0] if isinstance(output, tuple) else output)[0].clone()

        return hook

    blocks = model.model.layers
    handles = [blocks[layer].register_forward_hook(clamp)]
    handles += [block.register_forward_hook(keep(i)) for i, block in enumerate(blocks)]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
        return seen
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("layer", [1, 2])
async def test_a_clamp_sets_the_features_activation_as_written_out_independently(
    engine: Any, saes: list[Path], tiny_model_dir: Path, layer: int
) -> None:
    folder = saes[layer - 1]
    p = prompt(engine)
    plain, _ = await run(engine, p, **spec(p, watch=(5,)))
    # the feature most often active at this layer over the prompt, clamped to a value it never takes
    counts = np.zeros(256)
    for e in plain:
        counts[e.features.ids[layer - 1]] += 1
    feature = int(counts.argmax())
    target = 7.5
    entry = SteeringEntry(layer=layer, scale=0.0, feature=feature, clamp=target)
    events, _ = await run(engine, p, **spec(p, entry, watch=(feature,)))
    assert not same(plain, events)
    hidden = clamped_pass(tiny_model_dir, folder, layer, feature, target, [e.id for e in events])
    acts = encode(folder, hidden[layer])  # what the engine's feature hook sees: the clamped stream
    reported = np.array([float(e.features.watched[layer - 1][0]) for e in events])
    assert np.allclose(reported, acts[:, feature].numpy(), atol=1e-3)
    # and the top features of every position at every layer, from the same independent pass
    for e in events:
        for i, lay in enumerate((1, 2)):
            values, ids = torch.topk(encode(saes[i], hidden[lay][e.position : e.position + 1])[0], 4)
            assert np.allclose(e.features.values[i], values[values > 0].numpy(), atol=1e-3)
            assert e.features.ids[i].tolist() == ids[values > 0].tolist()


async def test_clamping_a_silent_feature_to_zero_adds_a_zero_vector(engine: Any) -> None:
    """Where a feature is silent, clamping it to 0 adds ``0 * W_dec[f]``: bit for bit the unsteered run."""
    p = prompt(engine)
    everything = tuple(range(256))
    plain, _ = await run(engine, p, **spec(p, watch=everything))
    active = np.stack([e.features.watched[1] for e in plain])  # [positions, 256] at layer 2
    silent = int(np.flatnonzero(~active.any(axis=0))[0])
    events, _ = await run(
        engine, p, **spec(p, SteeringEntry(layer=2, scale=0.0, feature=silent, clamp=0.0), watch=everything)
    )
    assert same(plain, events)


async def test_a_gate_on_a_feature_opens_where_its_activation_one_position_earlier_passes(engine: Any) -> None:
    p = prompt(engine)
    n = len(p)
    plain, _ = await run(engine, p, **spec(p))
    counts = np.zeros(256)
    for e in plain[:n]:
        counts[e.features.ids[0]] += 1
    feature = int(counts.argmax())
    watched, _ = await run(engine, p, **spec(p, watch=(feature,)))
    activation = [float(e.features.watched[0][0]) for e in watched]  # layer 1
    gate = Gate(concept=None, feature=feature, layer=1, comparison=Comparison.ABOVE, threshold=0.0)
    entry = SteeringEntry(layer=1, scale=8.0, concept="concept1", gate=gate)
    events, _ = await run(engine, p, **spec(p, entry))
    moved = []
    for a, s in zip(plain[:n], events[:n], strict=True):
        delta = float(s.readout[1, 1] - a.readout[1, 1])
        assert delta == 0.0 or abs(delta - 8.0) < 1e-2, (a.position, delta)
        if delta:
            moved.append(a.position)
    expected = [q for q in range(1, n) if activation[q - 1] > 0.0]
    assert 0 < len(expected) < n - 1 and moved == expected
    # never open: exactly unsteered
    shut = replace(entry, gate=replace(gate, threshold=1e30))
    assert same(plain, (await run(engine, p, **spec(p, shut)))[0])


def mixed_steerings() -> list[tuple[SteeringEntry, ...]]:
    gate = Gate(concept=None, feature=3, layer=1, comparison=Comparison.BELOW, threshold=0.5)
    return [
        (SteeringEntry(layer=2, scale=0.0, feature=9, clamp=4.0),),
        (),
        (SteeringEntry(layer=1, scale=5.0, feature=2), SteeringEntry(layer=2, scale=0.0, feature=9, clamp=-2.0)),
        (SteeringEntry(layer=2, scale=6.0, feature=40, gate=gate, positions=Positions.GENERATED),),
        (),
    ]


async def test_feature_steered_requests_are_the_same_alone_and_batched(engine: Any) -> None:
    ps = [prompt(engine, t) for t in ("a", "a longer question about prisms", "mid length", TEXT, "plain one")]
    steerings = mixed_steerings()
    alone = [await run(engine, p, **spec(p, *s, deterministic=True)) for p, s in zip(ps, steerings, strict=True)]
    before = engine.stats["batched_steps"]
    mixed = await asyncio.gather(
        *(run(engine, p, **spec(p, *s, deterministic=True)) for p, s in zip(ps, steerings, strict=True))
    )
    assert engine.stats["batched_steps"] - before > 5
    for (a, _), (m, _) in zip(alone, mixed, strict=True):
        assert same(a, m)


async def test_a_sessions_cache_serves_only_under_the_same_feature_steering(engine: Any) -> None:
    key = uuid.uuid4().hex
    p = prompt(engine)
    clamp = SteeringEntry(layer=2, scale=0.0, feature=9, clamp=4.0)
    short = {"max_tokens": 4, "ignore_eos": True}
    await run(engine, p, key, **short, steering=(clamp,))
    # another clamp value, another feature, a scale instead: each a different spec, the cache does not serve
    for other in (replace(clamp, clamp=3.0), replace(clamp, feature=10), replace(clamp, clamp=None, scale=4.0)):
        _, done = await run(engine, p, key, **short, steering=(other,))
        assert done.cached_tokens == 0, other
        _, done = await run(engine, p, key, **short, steering=(clamp,))  # back: recomputed, then kept again
        assert done.cached_tokens == 0
    _, done = await run(engine, p, key, **short, steering=(clamp,))
    assert done.cached_tokens > 0


async def test_a_clamp_reads_back_as_its_target_where_the_encoder_inverts_the_decoder(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With orthonormal decoder rows, ``W_enc = W_dec^T`` and every pre-activation positive, encoding
    ``h + (v - a) * W_dec[f]`` gives exactly ``v`` for feature ``f``: the clamp reads back as its target."""
    q, _ = torch.linalg.qr(torch.randn(128, 64, generator=torch.Generator().manual_seed(3)))
    tensors = {"W_dec": q.T.contiguous(), "W_enc": q.contiguous(), "b_enc": torch.full((64,), 50.0)}
    folder = write_sae(tmp_path / "inverse", "standard", d_sae=64, layer=1, tensors=tensors)
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", threads=1, saes=((folder, None),))
    await eng.start()
    try:
        p = prompt(eng)
        end = len(p) + MAX
        features = FeatureSpec(top_k=1, layers=(1,), ids=(7, 8), ranges=(PositionRange(0, end),))
        base = {"max_tokens": MAX, "ignore_eos": True, "features": features}
        plain, _ = await run(eng, p, **base)
        assert all(40.0 < float(e.features.watched[0][0]) < 60.0 for e in plain)  # every feature active
        for target in (12.5, 80.0):
            entry = SteeringEntry(layer=1, scale=0.0, feature=7, clamp=target)
            events, _ = await run(eng, p, **base, steering=(entry,))
            read_back = np.array([float(e.features.watched[0][0]) for e in events])
            assert np.allclose(read_back, target, atol=1e-3), read_back
            # feature 8 (orthogonal) is left where the stream puts it: at prompt positions, exactly where it was
            n = len(p)
            others = [float(e.features.watched[0][1]) for e in events[:n]]
            assert np.allclose(others, [float(e.features.watched[0][1]) for e in plain[:n]], atol=1e-3)
    finally:
        await eng.close()
