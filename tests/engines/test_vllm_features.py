"""SAE features on the vLLM engine: computed in its compiled graph, through a real server over OpenAI.

The tiny model (3 layers, hidden 128) with two random TopK SAEs (after layers 0 and 1, labels on
the first) and the concept pack, served by vLLM with its default compilation, float32, prefix
cache shared across sessions (``cache_scope="global"``, so the rescoring path is reachable too).
A token's features must be what the reference encoder
(:class:`~prismgate.engines.sae.encode.SaeEncoder`, itself checked against ``sae-lens`` in
tests/sae/test_sae_lens.py, and the transformers engine's encoder) computes from a plain
transformers forward pass over the same tokens: the same ids in the same order and their
activations within ``TOL``.

Tolerance: activations ``|vllm - reference| <= 1e-3 * max(1, |reference|)``, the readouts'
cross-check tolerance (tests/engines/test_vllm_crosscheck.py): both sides run float32 on CPU, so
what differs is only the order of additions in vLLM's kernels, its compiled graph and its fused
residual add against transformers' eager layers; the encoder multiplies that difference by
``W_enc``, at most a few units here (measured worst printed by the first test). An id may swap
with its neighbour only where their reference activations lie within that tolerance.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from prismgate.core.actions import PositionRange
from prismgate.core.features import FeatureSpec
from tests.conftest import TINY_MODEL_ID, LiveServer, run_server, tiny_settings
from tests.engines.requests import run
from tests.engines.vllm_factory import make_vllm_engine, require_vllm
from tests.sae.saes import assert_same_features, labelled_pair, streamed_features

pytestmark = pytest.mark.vllm

PROMPT = [1, 17, 42, 99, 7, 3, 250, 11]
WATCHED = [3, 200]
RTOL = 1e-3
SAME = 1e-4  # the same positions computed by two vLLM paths (store or rescoring vs a fresh run)


@pytest.fixture(scope="module")
def saes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return labelled_pair(tmp_path_factory.mktemp("vllm-saes"))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_pack: Path, saes: list[Path]) -> Iterator[LiveServer]:
    require_vllm()
    engine = make_vllm_engine(
        tiny_model_dir,
        model_id=TINY_MODEL_ID,
        concept_pack=tiny_pack,
        saes=tuple((folder, None) for folder in saes),
        cache_scope="global",
    )
    settings = tiny_settings(tiny_model_dir, tiny_pack, sae=",".join(map(str, saes)))
    with run_server(settings, engine=engine) as srv:
        yield srv


def complete(server: LiveServer, **body: Any) -> dict[str, Any]:
    payload = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    response = httpx.post(server.http_url + "/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def reference(model_dir: Path, saes: list[Path], tokens: list[int]) -> list[torch.Tensor]:
    """The reference encoder's activations ``[tokens, d_sae]`` at each SAE's layer, from one transformers pass."""
    from transformers import AutoModelForCausalLM

    from prismgate.engines.sae.encode import SaeEncoder
    from prismgate.engines.sae.files import load_sae

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        encoders = [SaeEncoder(load_sae(folder)) for folder in saes]
        return [e.encode(hidden[e.layer + 1][0]) for e in encoders]


def close(got: float, want: float) -> bool:
    return abs(got - want) <= RTOL * max(1.0, abs(want))


def check_layer(entry: dict[str, Any], acts: torch.Tensor, k: int, watched: list[int]) -> float:
    """One token's features at one layer against the reference activations; returns the worst difference."""
    values, ids = torch.topk(acts, k)
    want = [(int(i), float(v)) for i, v in zip(ids, values, strict=True) if v > 0]
    got = [(x["id"], x["activation"]) for x in entry["top"]]
    assert len(got) == len(want)
    worst = 0.0
    for (gid, gval), (wid, wval) in zip(got, want, strict=True):
        assert close(gval, wval), (gval, wval)  # the k largest values, in order
        assert gid == wid or close(float(acts[gid]), wval), (gid, wid)  # an id swaps only with a near-tie
        worst = max(worst, abs(gval - float(acts[gid])))
    for value, f in zip(entry["watched"], watched, strict=True):
        assert close(value, float(acts[f]))
    return worst


def test_features_equal_the_reference_encoder_on_the_models_own_stream(
    server: LiveServer, tiny_model_dir: Path, saes: list[Path]
) -> None:
    """Prompt (echo) and decoded positions, both SAE layers, top ids, activations, watched ids and labels."""
    body = complete(server, echo=True, features={"top_k": 4, "ids": WATCHED})
    assert body["prismgate"]["features"] == {"layers": [0, 1], "top_k": 4, "ids": WATCHED}
    tokens = body["choices"][0]["prismgate"]["features"]
    assert [t["position"] for t in tokens] == list(range(len(PROMPT) + 4))
    acts = reference(tiny_model_dir, saes, [t["id"] for t in tokens])
    worst = 0.0
    for token in tokens:
        p = token["position"]
        assert [x["layer"] for x in token["layers"]] == [0, 1]
        for layer_acts, entry in zip(acts, token["layers"], strict=True):
            worst = max(worst, check_layer(entry, layer_acts[p], 4, WATCHED))
        assert all(x["label"] == f"feature {x['id']}" for x in token["layers"][0]["top"] if x["id"] % 2 == 0)
        assert all("label" not in x for x in token["layers"][1]["top"])
    print(f"worst |vllm - reference| activation: {worst:.2e}")


def test_a_stream_carries_the_same_features(server: LiveServer) -> None:
    whole = complete(server, features={"top_k": 3, "layers": [1]})["choices"][0]["prismgate"]["features"]
    payload = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
               "features": {"top_k": 3, "layers": [1]}}  # fmt: skip
    streamed = streamed_features(server.http_url, payload, timeout=120)
    assert streamed == whole and len(whole) == 4
    assert all([x["layer"] for x in t["layers"]] == [1] for t in whole)


def test_requests_decoded_in_one_batch_each_get_their_own_features(server: LiveServer) -> None:
    """Concurrent requests share engine steps (one encoder call per step: the largest k, every row's ids)."""
    asks = [{"top_k": 2}, {"top_k": 5, "ids": [7]}, {"top_k": 0, "ids": WATCHED, "layers": [0]}]

    def ask(features: dict[str, Any]) -> list[Any]:
        return list(complete(server, features=features, max_tokens=12)["choices"][0]["prismgate"]["features"])

    receiver = server.engine._receiver  # type: ignore[attr-defined]
    steps = receiver.steps
    alone = [ask(f) for f in asks]
    alone_steps, steps = receiver.steps - steps, receiver.steps
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(ask, asks))
    assert receiver.steps - steps < alone_steps, "the requests never shared an engine step"
    for a, b in zip(alone, together, strict=True):
        assert_same_features(a, b, SAME)
    assert all(len(entry["top"]) == 0 and len(entry["watched"]) == 2 for t in together[2] for entry in t["layers"])


def spec_features(top_k: int, ids: tuple[int, ...] = (), end: int = 200) -> FeatureSpec:
    return FeatureSpec(top_k=top_k, layers=(0, 1), ids=ids, ranges=(PositionRange(0, end),))


def pairs(event: Any) -> list[list[tuple[int, float]]]:
    f = event.features
    assert f is not None
    return [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(f.ids, f.values, strict=True)]


def same(a: Any, b: Any) -> None:
    for x, y in zip(pairs(a), pairs(b), strict=True):
        assert [i for i, _ in x] == [i for i, _ in y], a.position
        assert np.allclose([v for _, v in x], [v for _, v in y], atol=SAME), a.position
    if a.features.watched is not None or b.features.watched is not None:
        assert np.allclose(a.features.watched, b.features.watched, atol=SAME)


def test_features_at_cached_positions_come_from_the_session_store_or_a_recomputation(server: LiveServer) -> None:
    """A later turn's features at positions vLLM serves from its prefix cache equal a fresh run's."""
    engine = server.engine
    key = uuid.uuid4().hex
    t1 = tuple((PROMPT * 10)[:80])

    async def go(tokens: tuple[int, ...], session: str | None, **spec: Any) -> Any:
        return await run(engine, tokens, session, **spec)

    out1, _ = server.call(go(t1, key, max_tokens=4, ignore_eos=True, features=spec_features(2, (3,), 84)), 120)
    assert [e.position for e in out1] == list(range(84))
    t2 = t1 + tuple(e.id for e in out1 if not e.is_prefill) + (5, 6, 7, 8, 9)
    stats = engine.stats  # type: ignore[attr-defined]
    skips, rescored = stats["cache_skips"], stats["rescored"]
    # the store holds every top feature the worker keeps: a larger top_k than turn 1 asked is served too
    events, done = server.call(go(t2, key, max_tokens=0, features=spec_features(5, (3,))), 120)
    assert done.cached_tokens == 64 and stats["cache_skips"] == skips  # reused, not recomputed
    assert [e.position for e in events] == list(range(len(t2)))
    fresh, fresh_done = server.call(go(t2, None, max_tokens=0, features=spec_features(5, (3,))), 120)
    # no session, no store: vLLM's (global) cache served the prefix, so the engine recomputed it once
    assert fresh_done.cached_tokens > 0 and stats["rescored"] == rescored + 1
    for a, b in zip(events, fresh, strict=True):
        same(a, b)
    # another watched id: the store cannot answer it, so this turn skips the cache
    other, other_done = server.call(go(t2, key, max_tokens=0, features=spec_features(5, (3, 77))), 120)
    assert stats["cache_skips"] == skips + 1 and other_done.cached_tokens == 0
    for a, b in zip(other, fresh, strict=True):
        assert [p[0] for p in pairs(a)[0]] == [p[0] for p in pairs(b)[0]]
        assert a.features is not None and a.features.watched is not None
        assert np.allclose(a.features.watched[:, :1], b.features.watched, atol=SAME)


def test_the_models_sae_layers_are_advertised_and_a_request_without_features_gets_none(server: LiveServer) -> None:
    info = server.engine.info
    assert info.features is not None and info.features.layers == (0, 1) and info.features.widths == (256, 256)
    assert info.features.label(0, 2) == "feature 2" and info.features.label(1, 2) is None
    choice = complete(server)["choices"][0]
    assert "features" not in (choice.get("prismgate") or {})


def test_steering_by_feature_goes_through_the_openai_wire(server: LiveServer) -> None:
    """The engine steers by feature, so the core lets the entries through: a clamp and a feature's direction
    change what the layer's SAE reads after them (the cross-checks are tests/engines/test_vllm_feature_steering.py)."""
    ask = {"top_k": 3, "layers": [1], "ids": [3]}
    plain = complete(server, features=ask)["choices"][0]
    steering = [{"feature": 3, "layer": 1, "clamp": 20}, {"feature": 9, "layer": 0, "scale": 4}]
    steered = complete(server, features=ask, steering=steering)["choices"][0]
    assert steered["prismgate"]["features"] != plain["prismgate"]["features"]
    info = server.engine.info
    assert info.steering_features and info.features is not None
    payload = {
        "model": TINY_MODEL_ID,
        "prompt": PROMPT,
        "max_tokens": 2,
        "steering": [{"feature": 256, "layer": 1, "scale": 1}],
    }
    refused = httpx.post(server.http_url + "/v1/completions", json=payload, timeout=60)
    assert refused.status_code == 400 and "feature 256 is outside the SAE's features [0, 256)" in refused.text
