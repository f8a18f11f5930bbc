"""The vLLM engine's SAE-feature parts that need no vLLM: the in-graph encoder op under torch.compile
(against :class:`~prismgate.engines.sae.encode.SaeEncoder`, the transformers engine's encoder), the side
channel's feature frames, the tracker, the session store's rule for stored features, a row cut to
what a request asked. These run in every environment (steering by feature: test_vllm_feature_steering_parts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prismgate.core.actions import PositionRange
from prismgate.core.errors import GatewayError
from prismgate.core.features import MAX_FEATURE_TOP_K, FeatureManifest, FeatureSpec
from prismgate.core.steering import spans
from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import load_sae
from prismgate.engines.vllm import sae_op
from prismgate.engines.vllm.channel import FeatureRows, StepPacket, decode_step, encode_step
from prismgate.engines.vllm.features import FeatureRow, event_features, top_width
from prismgate.engines.vllm.plan import make_plan, must_skip_cache, request_wants
from prismgate.engines.vllm.store import SessionValues
from prismgate.engines.vllm.tracker import Tracker
from tests.engines.test_vllm_parts import _Model
from tests.sae.saes import write_sae

pytestmark = pytest.mark.engine_suite

HIDDEN = 16


@pytest.mark.parametrize(("architecture", "k"), [("topk", 6), ("standard", None), ("jumprelu", None)])
def test_the_in_graph_encoder_equals_the_transformers_engines_under_torch_compile(
    tmp_path: Path, architecture: str, k: int | None
) -> None:
    """Top ids in order, activations and watched ids, at two layers, batches of several sizes through one graph."""
    torch.manual_seed(0)
    model = _Model(HIDDEN, 3).eval()
    saes = [
        load_sae(
            write_sae(tmp_path / f"l{layer}", architecture, d_in=HIDDEN, d_sae=96, layer=layer, k=k or 8, seed=layer)
        )
        for layer in (0, 2)
    ]
    encoders = [SaeEncoder(sae) for sae in saes]
    streams: dict[int, torch.Tensor] = {}
    handles = [
        model.model.layers[s.layer].register_forward_hook(
            lambda _m, _a, out, layer=s.layer: streams.__setitem__(layer, out[0] + out[1])
        )
        for s in saes
    ]
    inputs = [torch.randn(n, HIDDEN) for n in (5, 11, 2)]
    expected = []
    for x in inputs:
        with torch.no_grad():
            model(x)
        expected.append({s.layer: streams[s.layer].clone() for s in saes})
    for h in handles:
        h.remove()
    rows = 32
    shared = sae_op.FeatureBuffers(rows, "cpu")
    width = top_width(architecture, 96, k)
    assert width == (k if architecture == "topk" else MAX_FEATURE_TOP_K)
    outputs = sae_op.install(model, saes, rows, shared, width)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    watch = [3, 50, 95]
    for x, want in zip(inputs, expected, strict=True):
        n = x.shape[0]
        shared.flags[0], shared.flags[1] = 1, len(watch)
        shared.watch[:n, : len(watch)] = torch.tensor(watch)
        with torch.no_grad():
            compiled(x)
        for sae, encoder, out in zip(saes, encoders, outputs, strict=True):
            acts = encoder.encode(want[sae.layer])
            values, ids = torch.topk(acts, width, dim=-1, sorted=True)
            torch.testing.assert_close(out.values[:n], values, rtol=1e-5, atol=1e-5)
            active = values > 1e-4  # inactive features tie at 0: their order is nobody's business
            assert torch.equal(out.ids[:n].long()[active], ids[active])
            torch.testing.assert_close(out.watched[:n, : len(watch)], acts[:, watch], rtol=1e-5, atol=1e-5)
    before = [o.values.clone() for o in outputs]
    shared.flags[0] = 0  # a step nobody reads features in: the op leaves its buffers alone
    with torch.no_grad():
        compiled(torch.randn(4, HIDDEN))
    assert all(torch.equal(b, o.values) for b, o in zip(before, outputs, strict=True))


def test_feature_frames_round_trip_and_a_short_one_is_refused() -> None:
    ids = np.arange(2 * 2 * 3, dtype=np.int32).reshape(2, 2, 3)
    values = np.linspace(9, 1, 12, dtype=np.float32).reshape(2, 2, 3)
    watched = np.ones((2, 2, 1), np.float32)
    packet = StepPacket(step=4)
    packet.add("pg1", np.array([5, 6]), None, None, FeatureRows(ids, values, watched))
    packet.add("pg2", np.array([1]), None, None, FeatureRows(ids[:1], values[:1]))
    packet.add("pg3", np.array([1]), None)
    back = decode_step(encode_step(packet))
    one, two, three = back.requests
    assert one.features is not None and np.array_equal(one.features.ids, ids) and one.features.ids.dtype == np.int32
    assert np.array_equal(one.features.values, values) and np.array_equal(one.features.watched, watched)
    assert two.features is not None and two.features.watched is None and three.features is None
    frames = encode_step(packet)
    frames[3] = frames[3][:-4]  # one feature id short
    with pytest.raises(ValueError, match="feature ids"):
        decode_step(frames)


def _row(watch: tuple[int, ...] = (7,), k: int = 4) -> FeatureRow:
    ids = np.array([[9, 4, 7, 1][:k], [2, 3, 5, 6][:k]], np.int32)
    values = np.array([[5.0, 3.0, 1.0, 0.0][:k], [8.0, 0.0, 0.0, 0.0][:k]], np.float32)
    return FeatureRow(ids, values, watch, np.array([[1.0], [0.0]], np.float32) if watch else None)


def test_a_row_is_cut_to_the_request_layers_in_its_order_largest_first_inactive_left_out() -> None:
    manifest = FeatureManifest(layers=(3, 5), widths=(16, 16))
    spec = FeatureSpec(top_k=3, layers=(5, 3), ids=(7,))
    features = event_features(_row(), spec, manifest)
    assert features.layers == (5, 3)
    assert [i.tolist() for i in features.ids] == [[2], [9, 4, 7]]
    assert [v.tolist() for v in features.values] == [[8.0], [5.0, 3.0, 1.0]]
    assert features.watched is not None and features.watched.tolist() == [[0.0], [1.0]]


def test_a_stored_row_serves_only_requests_it_holds_enough_for() -> None:
    top = 4
    row = _row(watch=(7,), k=4)
    assert row.serves(FeatureSpec(top_k=64), top)  # the worker keeps 4: a request for more gets those 4
    assert row.serves(FeatureSpec(top_k=2, ids=(7,)), top)
    assert not row.serves(FeatureSpec(top_k=2, ids=(8,)), top)  # another watched id: recomputed
    assert not _row(k=2).serves(FeatureSpec(top_k=3), top)  # a request without a session sent only 2
    values = SessionValues([1, 2, 3], features={0: row, 2: row}, computed=3, steered=spans((), 3, 3))
    assert values.size == 2
    kept = values.valid_for([1, 9, 3], spans((), 3, 3))  # the timeline changed at position 1
    assert set(kept.features) == {0}


def test_the_tracker_keys_feature_rows_by_position_with_the_ids_it_watches() -> None:
    tracker = Tracker("pg1", watch=(7, 8))
    ids = np.zeros((2, 1, 3), np.int32)
    tracker.feed(
        np.array([4, 5]), None, None, None, FeatureRows(ids, ids.astype(np.float32), np.ones((2, 1, 2), np.float32))
    )
    assert set(tracker.features) == {4, 5} and tracker.features[5].watch == (7, 8)
    assert tracker.features[4].watched is not None and tracker.features[4].watched.shape == (1, 2)


def _plan_for(features: FeatureSpec | None, values: SessionValues | None = None, session: str | None = None) -> Any:
    from prismgate.core.actions import GenerateSpec
    from prismgate.core.engine import EngineInfo, EngineRequest

    info = EngineInfo("m", 512, 1000, (2,), tokenizer=None)  # type: ignore[arg-type]
    spec = GenerateSpec(max_tokens=3, features=features)
    request = EngineRequest("r", tuple(range(10, 50)), spec, session_key=session)
    return request, make_plan(request, info, False, values or SessionValues(), top=32)


def test_the_plan_looks_ahead_for_decoded_features_and_asks_the_worker_for_what_it_keeps() -> None:
    decoded = FeatureSpec(top_k=4, ids=(9,), layers=(3,), ranges=(PositionRange(40, 43),))
    request, plan = _plan_for(decoded)
    assert plan.lookahead and plan.fe_prompt == [] and not plan.decode_readouts
    assert request_wants("pg1", request, plan, False, True)["fe"] == {"k": 4, "ids": [9]}
    request, plan = _plan_for(decoded, session="s")  # a session's turn sends all the worker keeps, for the store
    assert request_wants("pg1", request, plan, False, True)["fe"] == {"k": 32, "ids": [9]}
    _, plan = _plan_for(None)
    assert plan.features is None and not plan.lookahead


def test_a_prompt_position_the_store_cannot_answer_skips_the_cache() -> None:
    spec = FeatureSpec(top_k=4, ids=(9,), layers=(3,), ranges=(PositionRange(0, 40),))
    row = FeatureRow(np.zeros((1, 32), np.int32), np.zeros((1, 32), np.float32), (9,), np.zeros((1, 1), np.float32))
    timeline = tuple(range(10, 50))
    stored = SessionValues(list(timeline), features={p: row for p in range(40)}, computed=40)
    _, plan = _plan_for(spec, stored)
    assert plan.missing_features() == [] and not must_skip_cache(plan, 0, 32)
    other = FeatureSpec(top_k=4, ids=(10,), layers=(3,), ranges=(PositionRange(0, 40),))
    _, plan = _plan_for(other, stored)
    assert plan.missing_features() == list(range(40)) and must_skip_cache(plan, 0, 32)


def test_the_workers_are_told_the_saes_and_a_wrong_or_unsupported_one_is_refused_at_start(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from prismgate.engines.vllm import config
    from prismgate.engines.vllm.worker import readout_settings

    good = write_sae(tmp_path / "good", layer=1)
    options = config.Options(model_path=tiny_model_dir, model_id="tiny", kv_cache_gb=1, saes=((good, None),))
    extra = config.engine_args(options, on_cpu=True)["additional_config"]
    assert extra["prismgate"]["saes"] == [str(good)] and len(extra["prismgate"]["sae_digest"]) == 16
    assert "pack" not in extra["prismgate"]  # SAEs without a concept pack: the worker still installs them

    class VllmConfig:
        additional_config = extra

    assert readout_settings(VllmConfig()) == extra["prismgate"]
    assert [s.layer for s in config.load_saes(options)] == [1]
    wide = write_sae(tmp_path / "wide", d_in=64, layer=1)
    with pytest.raises(GatewayError, match=r"wide/cfg\.json: d_in is 64"):
        config.load_saes(config.Options(model_path=tiny_model_dir, model_id="tiny", saes=((wide, None),)))
    staged = config.Options(model_path=tiny_model_dir, model_id="tiny", pipeline_parallel_size=2, saes=((good, None),))
    with pytest.raises(GatewayError, match="pipeline_parallel_size > 1"):
        config.load_saes(staged)
