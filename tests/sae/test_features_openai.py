"""SAE features per token on the OpenAI wire, on a real server: the numbers checked against SAELens.

The tiny model (3 layers, hidden 128) serves two random TopK SAEs, after layers 0 and 1. A
completion's features must be what SAELens computes from the model's own hidden states (one
full forward pass of the prompt and the answer, transformers' ``output_hidden_states``): the
top ids in order, their activations, and the watched ids' activations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.sae.saes import assert_same_features, streamed_features

sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is a dev dependency: make setup installs it")
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11]
WATCHED = [3, 200]


def complete(server: LiveServer, **body: Any) -> httpx.Response:
    payload = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(server.http_url + "/v1/completions", json=payload, timeout=60)


def reference(model_dir: Path, saes: list[Path], tokens: list[int]) -> list[torch.Tensor]:
    """SAELens's activations ``[tokens, d_sae]`` at each SAE's layer, from one plain forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return [
            sae_lens.SAE.load_from_disk(str(folder), dtype="float32").encode(hidden[layer + 1][0])
            for folder, layer in zip(saes, (0, 1), strict=True)
        ]


def test_features_match_sae_lens_on_the_models_own_stream(
    server: LiveServer, tiny_model_dir: Path, saes: list[Path]
) -> None:
    response = complete(server, features={"top_k": 4, "ids": WATCHED})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prismgate"]["features"] == {"layers": [0, 1], "top_k": 4, "ids": WATCHED}
    tokens = body["choices"][0]["prismgate"]["features"]
    assert [t["position"] for t in tokens] == list(range(len(PROMPT), len(PROMPT) + 4))
    acts = reference(tiny_model_dir, saes, PROMPT + [t["id"] for t in tokens])
    for token in tokens:
        p = token["position"]
        assert [x["layer"] for x in token["layers"]] == [0, 1]
        for layer_acts, entry in zip(acts, token["layers"], strict=True):
            values, ids = torch.topk(layer_acts[p], 4)
            assert [x["id"] for x in entry["top"]] == [int(i) for i, v in zip(ids, values, strict=True) if v > 0]
            assert [x["activation"] for x in entry["top"]] == pytest.approx(values[values > 0].tolist(), abs=1e-4)
            assert entry["watched"] == pytest.approx(layer_acts[p, WATCHED].tolist(), abs=1e-4)
        labelled = [x for x in token["layers"][0]["top"] if x["id"] % 2 == 0]
        assert all(x["label"] == f"feature {x['id']}" for x in labelled)
        assert all("label" not in x for x in token["layers"][1]["top"])


def test_a_stream_carries_the_same_features(server: LiveServer) -> None:
    whole = complete(server, features={"top_k": 3, "layers": [1]}).json()["choices"][0]["prismgate"]["features"]
    payload = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
               "features": {"top_k": 3, "layers": [1]}}  # fmt: skip
    streamed = streamed_features(server.http_url, payload)
    assert streamed == whole and len(whole) == 4


def test_a_session_turn_on_a_cached_prefix_gets_a_fresh_runs_features(server: LiveServer) -> None:
    """The second turn runs on the first turn's KV cache; its features equal those of one pass over everything."""
    opened = httpx.post(server.http_url + "/v1/sessions", json={"model": TINY_MODEL_ID}, timeout=30)
    assert opened.status_code == 200, opened.text
    session = opened.json()["id"]
    first = complete(server, session_id=session, max_tokens=2, features={"top_k": 1})
    answer = [t["id"] for t in first.json()["choices"][0]["prismgate"]["features"]]
    second = complete(server, session_id=session, prompt=[5, 6], features={"top_k": 3, "ids": WATCHED})
    fresh = complete(server, prompt=[*PROMPT, *answer, 5, 6], features={"top_k": 3, "ids": WATCHED})
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    turn = second.json()["choices"][0]["prismgate"]["features"]
    alone = fresh.json()["choices"][0]["prismgate"]["features"]
    assert [t["position"] for t in turn] == [t["position"] for t in alone]
    for a, b in zip(turn, alone, strict=True):
        for x, y in zip(a["layers"], b["layers"], strict=True):
            assert [f["id"] for f in x["top"]] == [f["id"] for f in y["top"]]
            assert [f["activation"] for f in x["top"]] == pytest.approx([f["activation"] for f in y["top"]], abs=1e-4)
            assert x["watched"] == pytest.approx(y["watched"], abs=1e-4)


@pytest.mark.parametrize(
    ("features", "fragment"),
    [
        ({"top_k": 65}, "top_k must be in [0, 64]"),
        ({"ids": [256]}, "outside the SAE's features [0, 256)"),
        ({"layers": [2]}, "features layer 2 has no SAE"),
        ({"ids": list(range(257))}, "at most 256 feature ids"),
        ({"colour": 1}, "unknown keys"),
        ({"top_k": 0}, "top_k > 0 or some ids"),
        ("yes", "must be true or an object"),
    ],
)
def test_mistakes_are_400_naming_the_field(server: LiveServer, features: object, fragment: str) -> None:
    response = complete(server, features=features)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["param"].startswith("features")


def test_a_model_without_an_sae_says_so(live_server: LiveServer) -> None:
    response = complete(live_server, features=True)
    assert response.status_code == 400
    assert "has no sparse autoencoder loaded" in response.json()["error"]["message"]


def test_requests_decoded_in_one_batch_each_get_their_own_features(server: LiveServer) -> None:
    """Concurrent requests share decode passes (one hook call: the largest k, the union of ids); each gets its own."""
    from concurrent.futures import ThreadPoolExecutor

    asks = [{"top_k": 2}, {"top_k": 5, "ids": [7]}, {"top_k": 0, "ids": WATCHED, "layers": [0]}]

    def run(features: dict[str, Any]) -> list[Any]:
        body = complete(server, features=features, max_tokens=12).json()
        return body["choices"][0]["prismgate"]["features"]

    alone = [run(f) for f in asks]
    batched_before = server_stats(server)
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(run, asks))
    assert server_stats(server) > batched_before, "the requests never shared a decode pass"
    for a, b in zip(alone, together, strict=True):
        assert_same_features(a, b, 1e-4)
    assert all(len(entry["top"]) == 0 and len(entry["watched"]) == 2 for t in together[2] for entry in t["layers"])


def server_stats(server: LiveServer) -> int:
    """Decode passes the tiny model's engine has run for several requests at once."""
    engine = server.service.pool.replicas(TINY_MODEL_ID).engines[0]
    return int(engine.stats["batched_steps"])  # type: ignore[attr-defined]


def test_the_models_list_names_the_saes(server: LiveServer) -> None:
    models = httpx.get(server.http_url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["prismgate"]["features"] == {"layers": [0, 1], "features": [256, 256], "labelled": [128, 0]}
