"""Images over Evergreen, end to end: image/* chunks on a tiny random Qwen2-VL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import websockets

from tests.evergreen.wire import Collector, b64, closed_with, generate, msg, parent, text_leaf
from tests.vision_model import build_tiny_qwen2_vl, image_bytes

MODEL = "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def vl_server(server_factory: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("evergreen-vl") / MODEL)
    with server_factory(model=str(folder), model_name=MODEL, concept_pack="none") as server:
        yield server


def image_leaf(node_id: str, data: bytes, mime: str = "image/png") -> dict:
    return {"id": node_id, "chunkFragment": {"metadata": {"mimetype": mime}, "data": b64(data)}}


async def test_an_image_chunk_becomes_a_vision_block_and_the_model_answers(vl_server: Any) -> None:
    async with websockets.connect(vl_server.ws_url + "/evergreen", max_size=None) as ws:
        c = Collector(ws)
        await ws.send(
            msg(
                actions=[generate("p", "r", config={"maxTokens": 5}, extra_outputs={"usage": "u"})],
                fragments=[
                    parent("p", "q", "img"),
                    text_leaf("q", "What is in this picture?"),
                    image_leaf("img", image_bytes(56, 84)),
                ],
            )
        )
        out = await c.until_complete("r", "u")
        usage = out["u"].lines[0]
        assert usage["completionTokens"] == 5
        # the prompt holds the text, the chat frame and a block of 2 + 6 pad tokens (56x84 -> 2x3 merged patches)
        assert usage["promptTokens"] >= 8 + len("What is in this picture?")
        assert len(out["r"].fragments) >= 1

        # a second turn refers to the first (image included) without resending it
        await ws.send(
            msg(
                actions=[generate("p2", "r2", config={"maxTokens": 3}, extra_outputs={"usage": "u2"})],
                fragments=[parent("p2", "p", "r", "q2"), text_leaf("q2", "And its colour?")],
            )
        )
        out2 = await c.until_complete("r2", "u2")
        usage2 = out2["u2"].lines[0]
        assert usage2["cachedTokens"] >= usage["promptTokens"]  # the image turn was not prefilled again


async def test_an_undecodable_image_aborts_with_a_reason(vl_server: Any) -> None:
    async with websockets.connect(vl_server.ws_url + "/evergreen", max_size=None) as ws:
        await ws.send(
            msg(
                actions=[generate("p", "r", config={"maxTokens": 2})],
                fragments=[parent("p", "q", "img"), text_leaf("q", "look"), image_leaf("img", b"not an image")],
            )
        )
        code, reason = await closed_with(ws)
        assert code == 4400 and "INVALID_ARGUMENT" in reason
