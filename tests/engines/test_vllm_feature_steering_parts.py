"""Steering by SAE feature in the vLLM engine's steering op, without vLLM: these run in every environment.

The op under torch.compile (a stand-in model whose layers add ``hidden + residual`` first, as
vLLM's decoder layers do) against the transformers engine's own steering hooks
(:class:`~prismgate.engines.hf.steering.Steerer`) on a model of the same weights that passes the
stream from layer to layer as transformers does: a feature with a scale, clamps (after another
vector at the same layer too), gates on a feature at an earlier and at the same layer, carried from
one step to the next, for each SAE architecture. Then the bit-exactness rules: a row that asks
nothing, and a clamp to the activation a row already has, leave the stream unwritten (bf16); what a
CUDA graph records computes what the host path computes; the engine side's encoding of the entries
and its refusals; a feature's direction is its decoder row as a raw direction, bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prismgate.core.errors import GatewayError
from prismgate.core.steering import Comparison, Gate, Positions, SteeringEntry
from prismgate.engines.hf.steering import RowPlan, Steerer
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.sae.encode import SaeEncoder, decoder_direction
from prismgate.engines.sae.files import SparseAutoencoder, load_sae
from prismgate.engines.vllm import capture, steer
from prismgate.engines.vllm.encoder import ARCHITECTURES, SaeWeights, activations_at, row_pre_activations
from prismgate.engines.vllm.steer_rows import SteeredRows, SteerWriter
from tests.sae.saes import write_sae

pytestmark = pytest.mark.engine_suite

HIDDEN = 16
D_SAE = 96
ROWS = 64
CONCEPTS = ("c0", "c1")


class _SumLayer(torch.nn.Module):
    """A vLLM decoder layer as prismgate's ops see one: it adds ``hidden + residual`` first, returns both parts."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden + residual
        return self.proj(stream), stream


class _VllmModel(torch.nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_SumLayer(HIDDEN) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for layer in self.model.layers:
            x, residual = layer(x, residual)
        return x + residual


class _StreamLayer(torch.nn.Module):
    """The same layer as transformers runs one: the stream in, the stream out (a tuple, as decoder layers return)."""

    def __init__(self, inner: _SumLayer) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, stream: torch.Tensor) -> tuple[torch.Tensor]:
        hidden, residual = self.inner(stream, torch.zeros_like(stream))
        return (hidden + residual,)


class _HfModel(torch.nn.Module):
    def __init__(self, vllm_model: _VllmModel) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_StreamLayer(copy.deepcopy(x)) for x in vllm_model.model.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)[0]
        return x


def _saes(root: Path, architecture: str) -> list[SparseAutoencoder]:
    """SAEs after layer 0 (a pack layer too) and layer 1 (an SAE only)."""
    return [
        load_sae(
            write_sae(root / f"l{layer}", architecture, d_in=HIDDEN, d_sae=D_SAE, layer=layer, k=6, seed=3 + layer)
        )
        for layer in (0, 1)
    ]


def _pack() -> ConceptPack:
    d = np.random.default_rng(4).standard_normal((1, len(CONCEPTS), HIDDEN)).astype(np.float32)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    return ConceptPack(directions=d, layers=(0,), concepts=CONCEPTS, model_id="stand-in")


def _threshold(values: torch.Tensor) -> float:
    """The middle of the widest gap between a feature's activations: far from every one of them."""
    v = np.sort(values.numpy())
    k = int(np.argmax(np.diff(v)))
    return float(v[k] + v[k + 1]) / 2


def _varied(acts: torch.Tensor, exclude: tuple[int, ...] = ()) -> int:
    """A feature active at some positions and not at others (the most distinct values among them)."""
    active = (acts > 0).sum(dim=0)
    distinct = [len(set(acts[:, f].tolist())) if 0 < int(active[f]) < acts.shape[0] else 0 for f in range(D_SAE)]
    for f in exclude:
        distinct[f] = 0
    return int(np.argmax(distinct))


class _Setup:
    """One stand-in model twice over (vLLM's op compiled, transformers' hooks), its SAEs, pack and requests."""

    def __init__(self, root: Path, architecture: str, rounds: int = 3) -> None:
        torch.manual_seed(0)
        self.vllm = _VllmModel(3).eval()
        self.hf = _HfModel(self.vllm).eval()
        self.saes = _saes(root, architecture)
        self.pack = _pack()
        weights = [SaeWeights(s, "cpu", decoder=True) for s in self.saes]
        _, self.buffers = capture.install(
            self.vllm, [self.pack.directions[0]], [0], ROWS, steering_rounds=rounds, saes=weights
        )
        self.compiled = torch.compile(self.vllm, backend="aot_eager", fullgraph=True, dynamic=True)
        self.writer = SteerWriter(self.buffers)
        self.encoders = [SaeEncoder(s) for s in self.saes]
        self.steerer = Steerer(self.hf, self.pack, None, self.encoders)
        self.slots = steer.RawSlots(len(steer.steering_layers([0], [0, 1])))

    def worker(self, key: str, steering: tuple[SteeringEntry, ...], n: int) -> dict[str, Any] | None:
        return steer.worker_steering(key, steering, n, [0], list(CONCEPTS), self.slots, sae_layers=[0, 1])

    def streams(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The unsteered stream after each layer, ``[tokens, hidden]``, from the transformers-style model."""
        seen: list[torch.Tensor] = []
        handles = [layer.register_forward_hook(lambda _m, _a, out: seen.append(out[0][0].clone())) for layer in
                   self.hf.model.layers]  # fmt: skip
        with torch.no_grad():
            self.hf(x[None])
        for h in handles:
            h.remove()
        return seen

    def reference(self, x: torch.Tensor, steering: tuple[SteeringEntry, ...], n: int) -> torch.Tensor:
        """What the transformers engine's hooks make of one request, all its tokens in one pass."""
        vectors = self.steerer.resolve(steering)
        with torch.no_grad(), self.steerer.plan([RowPlan(0, 0, x.shape[0], n, vectors)]):
            return self.hf(x[None])[0]

    def run(self, chunks: list[list[tuple[str, torch.Tensor, int, dict[str, Any] | None]]]) -> dict[str, torch.Tensor]:
        """Steps of several requests each, ``(key, rows, start, worker steering)``: each request's outputs in order."""
        out: dict[str, list[torch.Tensor]] = {}
        for step in chunks:
            x = torch.cat([rows for _, rows, _, _ in step])
            steered, lo = [], 0
            for key, rows, start, steering in step:
                if steering is not None:
                    steered.append(SteeredRows(key, lo, rows.shape[0], start, steering))
                lo += rows.shape[0]
            self.writer.plan(steered, x.shape[0])
            with torch.no_grad():
                y = self.compiled(x)
            self.writer.carry(steered)
            lo = 0
            for key, rows, _, _ in step:
                out.setdefault(key, []).append(y[lo : lo + rows.shape[0]])
                lo += rows.shape[0]
        return {key: torch.cat(parts) for key, parts in out.items()}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_the_compiled_op_steers_by_feature_as_the_transformers_engines_hooks_do(
    tmp_path: Path, architecture: str
) -> None:
    """Four requests in two steps (the second starts where the first stopped: gates carried across)."""
    s = _Setup(tmp_path, architecture)
    lengths, prompts, first = [9, 7, 8, 10], [6, 4, 5, 7], [6, 3, 5, 4]
    xs = [torch.randn(t, HIDDEN) for t in lengths]
    l0 = [s.encoders[0].encode(s.streams(x)[0]) for x in xs]  # unsteered activations, [tokens, d_sae]
    l1 = [s.encoders[1].encode(s.streams(x)[1]) for x in xs]
    g0, g1 = _varied(l0[3]), _varied(l1[3])
    raw = tuple(float(v) for v in np.random.default_rng(9).standard_normal(HIDDEN))
    steerings: dict[str, tuple[SteeringEntry, ...]] = {
        "feature": (
            SteeringEntry(layer=1, scale=3.0, feature=_varied(l1[0])),  # at the SAE's own layer only
            SteeringEntry(layer=0, scale=2.0, concept="c1"),
            SteeringEntry(layer=0, scale=0.5, feature=5, norm_match=True, positions=Positions.GENERATED),
        ),
        "clamp": (
            SteeringEntry(layer=0, scale=2.0, concept="c0"),
            SteeringEntry(layer=0, scale=0.0, feature=_varied(l0[1]), clamp=3.0),  # sees the stream round 0 made
            SteeringEntry(layer=1, scale=0.0, feature=_varied(l1[1]), clamp=0.0, positions=Positions.GENERATED),
        ),
        "plain": (),
        "gated": (
            SteeringEntry(
                layer=1,
                scale=3.0,
                direction=raw,
                gate=Gate(None, 0, Comparison.ABOVE, _threshold(l0[3][:, g0]), feature=g0),
            ),
            SteeringEntry(
                layer=1,
                scale=0.0,
                feature=_varied(l1[3], (g1,)),
                clamp=2.0,
                gate=Gate(None, 1, Comparison.BELOW, _threshold(l1[3][:, g1]), feature=g1),
            ),
        ),
    }
    keys = list(steerings)
    worker = {key: s.worker(key, steerings[key], n) for key, n in zip(keys, prompts, strict=True)}
    steps = [
        [(key, x[:a], 0, worker[key]) for key, x, a in zip(keys, xs, first, strict=True)],
        [(key, x[a:], a, worker[key]) for key, x, a in zip(keys, xs, first, strict=True)],
    ]
    got = s.run(steps)
    plain = s.run([[(key, x[:a], 0, None) for key, x, a in zip(keys, xs, first, strict=True)],
                   [(key, x[a:], a, None) for key, x, a in zip(keys, xs, first, strict=True)]])  # fmt: skip
    for key, x, n in zip(keys, xs, prompts, strict=True):
        want = s.reference(x, steerings[key], n)
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5)
        moved = [bool(not torch.equal(a, b)) for a, b in zip(got[key], plain[key], strict=True)]
        if key == "plain":
            assert not any(moved)  # untouched beside three steered neighbours, bit for bit
        elif key == "gated":
            assert 0 < sum(moved) < len(moved), moved  # the gates opened at some positions only
        else:
            assert all(moved), moved


def _bf16_setup(root: Path) -> tuple[_VllmModel, SteerWriter, SaeEncoder]:
    torch.manual_seed(0)
    model = _VllmModel(2).eval().to(torch.bfloat16)
    sae = load_sae(write_sae(root / "l0", "topk", d_in=HIDDEN, d_sae=D_SAE, layer=0, k=6, seed=1))
    _, buffers = capture.install(model, [], [], ROWS, steering_rounds=2, saes=[SaeWeights(sae, "cpu", decoder=True)])
    return model, SteerWriter(buffers), SaeEncoder(sae)


def test_a_clamp_to_the_activation_a_row_has_leaves_the_bf16_stream_unwritten(tmp_path: Path) -> None:
    """hidden and residual come out as they went in where the clamp moves nothing, as for a vector of scale 0;
    a row that asks nothing beside clamped rows is untouched; a clamp that moves the feature writes."""
    model, writer, encoder = _bf16_setup(tmp_path)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.model.layers[0].register_forward_hook(lambda _m, _a, out: seen.append((out[0].clone(), out[1].clone())))
    x = torch.randn(6, HIDDEN).to(torch.bfloat16)
    with torch.no_grad():
        writer.plan([], 6)
        model(x)
    h, r = seen[0]
    acts = encoder.encode(h + r)  # the clamp's own arithmetic: the stream in bf16, encoded in float32
    silent = int(torch.nonzero(acts.sum(dim=0) == 0)[0])  # inactive at every row: a clamp to 0 moves nothing
    slots = steer.RawSlots(1)
    for target in (0.0, 4.0):
        entry = SteeringEntry(layer=0, scale=0.0, feature=silent, clamp=target)
        steering = steer.worker_steering(f"c{target}", (entry,), 3, [], [], slots, sae_layers=[0])
        assert steering is not None
        writer.plan([SteeredRows(f"c{target}", 0, 3, 0, steering)], 6)  # rows 3-5 ask nothing
        with torch.no_grad():
            model(x)
    (plain_h, plain_r), (zero_h, zero_r), (clamped_h, clamped_r) = seen
    assert torch.equal(zero_h, plain_h) and torch.equal(zero_r, plain_r)
    assert torch.equal(clamped_h[3:], plain_h[3:]) and torch.equal(clamped_r[3:], plain_r[3:])
    assert not torch.equal(clamped_h[:3], plain_h[:3]) and bool((clamped_r[:3] == 0).all())


def test_what_a_cuda_graph_records_computes_what_the_host_path_computes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recorded, the op encodes every row in every round and writes every gate column whatever the host says;
    rows that clamp nothing select nothing, so it computes the host path's bits, and nothing when nobody steers."""
    s = _Setup(tmp_path, "topk")
    x = torch.randn(12, HIDDEN)
    acts = s.encoders[0].encode(s.streams(x)[0])
    g = _varied(acts)
    steerings = {
        "a": (
            SteeringEntry(layer=0, scale=2.0, concept="c0"),
            SteeringEntry(layer=0, scale=0.0, feature=_varied(acts, (g,)), clamp=3.0),
            SteeringEntry(layer=1, scale=2.5, feature=7, positions=Positions.GENERATED),
        ),
        "b": (
            SteeringEntry(
                layer=1, scale=0.0, feature=11, clamp=1.5, gate=Gate(None, 0, Comparison.ABOVE, 0.0, feature=g)
            ),
        ),
    }
    requests = [
        SteeredRows("a", 0, 4, 0, s.worker("a", steerings["a"], 2) or {}),  # rows 4-7: nobody's
        SteeredRows("b", 8, 4, 0, s.worker("b", steerings["b"], 4) or {}),
    ]

    def run_once() -> torch.Tensor:
        s.writer.plan(requests, 12)
        with torch.no_grad():
            out = s.vllm(x)
        s.writer.plan([], 12)
        return out

    lean = run_once()
    monkeypatch.setattr(capture, "recording", lambda hidden: True)
    recorded = run_once()
    with torch.no_grad():
        idle = s.vllm(x)  # recorded with nobody steering: every round and clamp selects nothing
    monkeypatch.undo()
    with torch.no_grad():
        plain = s.vllm(x)
    assert torch.equal(recorded, lean)
    assert torch.equal(idle, plain)
    assert not torch.equal(lean[:4], plain[:4]) and torch.equal(lean[4:8], plain[4:8])
    assert all(bool((b.sae.clamp_feature == -1).all()) for b in s.buffers if b.sae is not None)  # cleared


def test_the_engine_side_names_features_by_slot_and_refuses_what_the_graph_cannot_hold() -> None:
    slots = steer.RawSlots(3)
    gate = Gate(None, 0, Comparison.BELOW, 0.5, feature=9)
    steering = (
        SteeringEntry(layer=2, scale=4.0, feature=3),
        SteeringEntry(layer=2, scale=0.0, feature=5, clamp=-2.0, gate=gate),
        SteeringEntry(layer=0, scale=1.0, concept="b", gate=Gate("a", 0, Comparison.ABOVE, 0.0)),
    )
    # the pack at layers 0 and 4, SAEs at 0 and 2: slots 0 (layer 0), 1 (layer 4), 2 (layer 2)
    out = steer.worker_steering("k", steering, 7, [0, 4], ["a", "b"], slots, sae_layers=[0, 2])
    assert out is not None
    assert steer.steering_layers([0, 4], [0, 2]) == [0, 4, 2]
    first, second, third = out["e"]
    assert first == [2, 3, 4.0, 0, "both", None, None] and out["dec"] == [[2, 3, 3]]  # a raw row after a, b
    assert second == [2, 0, 0.0, 0, "both", [0, 2, 0, 0.5, 9], [5, -2.0]]  # gate column 2: after the 2 concepts
    assert third[5] == [0, 0, 1, 0.0] and third[6] is None
    many = tuple(
        SteeringEntry(layer=0, scale=1.0, concept="a", gate=Gate(None, 0, Comparison.ABOVE, 0.0, feature=i))
        for i in range(steer.FEATURE_GATES + 1)
    )
    with pytest.raises(GatewayError, match=r"steering entry 8: gate.feature: the vllm engine gates at most 8"):
        steer.worker_steering("m", many, 7, [0, 4], ["a", "b"], slots, rounds=16, sae_layers=[0, 2])
    with pytest.raises(GatewayError, match="layer 4 has no SAE"):
        steer.worker_steering("n", (SteeringEntry(layer=4, scale=1.0, feature=1),), 7, [0, 4], ["a"], slots)


def test_a_features_direction_is_its_decoder_row_as_a_raw_direction_bit_for_bit(tmp_path: Path) -> None:
    sae = load_sae(write_sae(tmp_path / "s", d_in=HIDDEN, d_sae=D_SAE, dtype=torch.float16))
    W_dec = SaeWeights(sae, "cpu", decoder=True).W_dec
    for f in (0, 17, D_SAE - 1):
        as_raw = SteeringEntry(layer=0, scale=1.0, direction=tuple(float(v) for v in sae.W_dec[f]))
        assert torch.equal(decoder_direction(W_dec, f), torch.tensor(as_raw.unit_direction(), dtype=torch.float32))
        assert torch.equal(decoder_direction(W_dec, f), decoder_direction(SaeEncoder(sae).W_dec, f))


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_the_activation_of_chosen_features_is_the_reference_encoders(tmp_path: Path, architecture: str) -> None:
    sae = load_sae(write_sae(tmp_path / "s", architecture, d_in=HIDDEN, d_sae=D_SAE, k=6, seed=2))
    w, encoder = SaeWeights(sae, "cpu", decoder=False), SaeEncoder(sae)
    x = torch.randn(5, HIDDEN)
    acts = encoder.encode(x)
    ids = torch.stack([torch.argsort(-acts[i])[[0, 1, 50]] for i in range(5)])  # two active, one (likely) not
    pre = row_pre_activations(x, w.W_enc, w.b_enc, w.b_dec)
    torch.testing.assert_close(activations_at(pre, ids, w.arch, w.k, w.threshold), acts.gather(1, ids))
