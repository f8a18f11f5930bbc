"""SAE features over GraphPipe: ``config.features`` and the feature output tensors, equal to the OpenAI wire's."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from graphpipe import remote

from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.graphpipe.helpers import infer_buffer, read_response

PROMPTS = [[1, 17, 42, 99, 7, 3, 250, 11], [5, 6, 7]]
CONFIG = '{"max_tokens": 4, "features": {"top_k": 3, "ids": [3, 200]}}'
NAMES = ["tokens", "lengths", "feature_ids", "feature_values", "watched_features"]


def openai_features(server: LiveServer, prompt: list[int]) -> list[dict[str, object]]:
    body = httpx.post(
        server.http_url + "/v1/completions",
        json={"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0,
              "features": {"top_k": 3, "ids": [3, 200]}},
        timeout=60,
    ).json()  # fmt: skip
    return body["choices"][0]["prismgate"]["features"]  # type: ignore[no-any-return]


def test_feature_tensors_equal_the_openai_wires_features(server: LiveServer) -> None:
    width = max(map(len, PROMPTS))
    tokens_in = np.full((2, width), -1, dtype=np.int32)
    for i, p in enumerate(PROMPTS):
        tokens_in[i, : len(p)] = p
    tokens, lengths, ids, values, watched = remote.execute_multi(
        server.http_url + "/graphpipe", [tokens_in], ["tokens"], NAMES, CONFIG
    )
    m = int(lengths.max())
    assert ids.dtype == np.int32 and ids.shape == (2, m, 2, 3)
    assert values.dtype == np.float32 and values.shape == (2, m, 2, 3)
    assert watched.shape == (2, m, 2, 2)
    for row, prompt in enumerate(PROMPTS):
        for j, token in enumerate(openai_features(server, prompt)):
            assert token["id"] == tokens[row, j]
            for li, layer in enumerate(token["layers"]):  # type: ignore[arg-type]
                top = layer["top"]
                assert ids[row, j, li, : len(top)].tolist() == [f["id"] for f in top]
                assert (ids[row, j, li, len(top) :] == -1).all()
                np.testing.assert_allclose(values[row, j, li, : len(top)], [f["activation"] for f in top], atol=1e-5)
                np.testing.assert_allclose(watched[row, j, li], layer["watched"], atol=1e-5)
        assert (ids[row, int(lengths[row]) :] == -1).all()


@pytest.mark.parametrize(
    ("names", "config", "fragment"),
    [
        (["feature_ids"], '{"max_tokens": 2}', "need config.features"),
        (["watched_features"], '{"features": {"top_k": 2}}', "needs config.features.ids"),
        (["text"], '{"features": true}', "name one of the outputs"),
        (["feature_ids"], '{"features": {"top_k": 99}}', "config.features: features top_k must be in [0, 64]"),
        (["feature_ids"], '{"features": {"layers": [2]}}', "features layer 2 has no SAE"),
    ],
)
def test_feature_mistakes_are_named(server: LiveServer, names: list[str], config: str, fragment: str) -> None:
    body = infer_buffer([np.array(["hello"])], ["prompt"], names, config)
    response = httpx.post(server.http_url + "/graphpipe", content=body, timeout=60)
    _, errors = read_response(response.content)
    message = errors[0]["message"] if errors else b""
    assert fragment in (message.decode() if isinstance(message, bytes) else message), errors


def test_the_metadata_lists_the_feature_outputs(server: LiveServer) -> None:
    meta = httpx.get(server.http_url + "/graphpipe", timeout=10).json()
    outputs = {o["Name"]: o for o in meta["Outputs"]}
    assert {"feature_ids", "feature_values", "watched_features"} <= set(outputs)
    assert "SAE layers [0, 1]" in outputs["feature_ids"]["Description"]
