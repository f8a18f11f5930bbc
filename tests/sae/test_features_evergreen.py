"""SAE features over Evergreen: a ``features`` output (NDJSON) beside ``readouts``, equal to the OpenAI wire's."""

from __future__ import annotations

import httpx
import pytest
import websockets

from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.evergreen.wire import Collector, closed_with, generate, msg, text_leaf

FEATURES = {"topK": 3, "ids": [3, 200]}


def openai_chat_features(server: LiveServer) -> list[dict[str, object]]:
    body = httpx.post(
        server.http_url + "/v1/chat/completions",
        json={"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
              "temperature": 0, "features": {"top_k": 3, "ids": [3, 200]}},
        timeout=60,
    ).json()  # fmt: skip
    return body["choices"][0]["prismgate"]["features"]  # type: ignore[no-any-return]


async def test_the_features_output_streams_what_the_openai_wire_returns(server: LiveServer) -> None:
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        action = generate("p", "r", config={"maxTokens": 4, "features": FEATURES}, extra_outputs={"features": "f"})
        await ws.send(msg(actions=[action], fragments=[text_leaf("p", "Hi")]))
        outs = await Collector(ws).until_complete("r", "f")
    assert outs["f"].metadata["mimetype"] == "application/x-ndjson; schema=prismgate.features.v1"
    header, *rows = outs["f"].lines
    assert header == {"model": TINY_MODEL_ID, "layers": [0, 1], "topK": 3, "ids": [3, 200]}
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    reference = openai_chat_features(server)
    assert [r["tokenId"] for r in rows] == [t["id"] for t in reference]
    for row, token in zip(rows, reference, strict=True):
        assert row["position"] == token["position"]
        for a, b in zip(row["layers"], token["layers"], strict=True):  # type: ignore[arg-type]
            assert [f["id"] for f in a["top"]] == [f["id"] for f in b["top"]]
            assert [f["activation"] for f in a["top"]] == pytest.approx([f["activation"] for f in b["top"]], abs=1e-5)
            assert a["watched"] == pytest.approx(b["watched"], abs=1e-5)


@pytest.mark.parametrize(
    ("config", "outputs", "fragment"),
    [
        ({"features": {"topK": 99}}, {"features": "f"}, "features top_k must be in [0, 64]"),
        ({"features": {"topK": 2}}, {}, "add a 'features' output"),
        ({"features": {"layers": [2]}}, {"features": "f"}, "features layer 2 has no SAE"),
    ],
)
async def test_feature_mistakes_close_the_socket_naming_them(
    server: LiveServer, config: dict[str, object], outputs: dict[str, str], fragment: str
) -> None:
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        action = generate("p", "r", config={"maxTokens": 2, **config}, extra_outputs=outputs)
        await ws.send(msg(actions=[action], fragments=[text_leaf("p", "Hi")]))
        code, reason = await closed_with(ws)
    assert code == 4400 and fragment in reason, (code, reason)
