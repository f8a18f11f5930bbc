"""The ``steering`` field on every wire that has one, end to end over real sockets (tiny model)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import numpy as np
import websockets

from tests.conftest import TINY_MODEL_ID
from tests.evergreen.wire import Collector, closed_with, generate, msg, parent, text_leaf, uid
from tests.graphpipe.helpers import infer_buffer, read_response

PUSH = [{"concept": "concept1", "layer": 0, "scale": 60}]


def chat(server: Any, steering: Any = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": "steer this answer"}],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }
    if steering is not None:
        body["steering"] = steering
    return httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=60)


def test_openai_chat_and_completions_take_steering(live_server: Any) -> None:
    plain, steered, zero = chat(live_server), chat(live_server, PUSH), chat(live_server, [{**PUSH[0], "scale": 0}])
    assert plain.status_code == steered.status_code == zero.status_code == 200, steered.text
    text = [r.json()["choices"][0]["message"]["content"] for r in (plain, steered, zero)]
    assert text[0] != text[1] and text[0] == text[2]
    body = {"model": TINY_MODEL_ID, "prompt": "steer this text", "max_tokens": 12, "temperature": 0}
    a = httpx.post(live_server.http_url + "/v1/completions", json=body, timeout=60).json()
    b = httpx.post(live_server.http_url + "/v1/completions", json={**body, "steering": PUSH}, timeout=60).json()
    assert a["choices"][0]["text"] != b["choices"][0]["text"]


def test_openai_refuses_bad_steering_naming_the_field(live_server: Any) -> None:
    cases = [
        ([{"concept": "nope", "layer": 0, "scale": 1}], "unknown concept 'nope'"),
        ([{"concept": "concept1", "layer": 2, "scale": 1}], "layer 2 is not a layer of the concept pack"),
        ([{"concept": "concept1", "layer": 0, "scale": 1e9}], "must be in [-256, 256]"),
        ([{"concept": "concept1", "layer": 0, "scale": 5, "norm_match": True}], "must be in [-4, 4]"),
        ([{"direction": [1.0, 2.0], "layer": 0, "scale": 1}], "hidden size is 128"),
        ([{"layer": 0, "scale": 1}], "exactly one of the two"),
        ([{"concept": "concept1", "layer": 0, "scale": 1, "positions": "all"}], "positions must be one of"),
        ([{"concept": "concept1", "layer": 0, "scale": 1, "extra": 1}], "unknown keys 'extra'"),
        ([{"concept": "concept1", "layer": 0, "scale": 1}] * 9, "9 steering entries; the limit is 8"),
        ({"concept": "concept1"}, "must be a list"),
    ]
    for steering, message in cases:
        r = chat(live_server, steering)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "steering" and message in error["message"], (message, r.text)


def test_graphpipe_config_steers_every_row(live_server: Any) -> None:
    def infer(config: str) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
        body = infer_buffer([np.array(["steer a", "steer b"])], ["prompt"], ["tokens"], config)
        r = httpx.post(live_server.http_url + "/graphpipe", content=body, timeout=60)
        return read_response(r.content)

    (plain,), _ = infer('{"max_tokens": 8}')
    (steered,), _ = infer('{"max_tokens": 8, "steering": [{"concept": "concept1", "layer": 0, "scale": 60}]}')
    assert plain.shape == steered.shape and (plain != steered).any(axis=1).all()
    _, errors = infer('{"steering": [{"concept": "nope", "layer": 0, "scale": 1}]}')
    assert errors and errors[0]["code"] == 3 and b"unknown concept 'nope'" in errors[0]["message"]
    gate = {"concept": "concept0", "layer": 0, "comparison": "above", "threshold": 1e30}
    entry = {"concept": "concept1", "layer": 1, "scale": 60, "gate": gate}
    (never,), _ = infer(json.dumps({"max_tokens": 8, "steering": [entry]}))
    assert (never == plain).all()
    _, errors = infer(
        '{"steering": [{"concept": "concept1", "layer": 1, "scale": 1, "gate": {"concept": "concept0"}}]}'
    )
    assert (
        errors
        and errors[0]["code"] == 3
        and b"config.steering[0].gate.layer must be an integer" in errors[0]["message"]
    )


async def evergreen_turn(server: Any, config: dict[str, Any]) -> str:
    prompt, response = uid(), uid()
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        await ws.send(
            msg(
                actions=[generate(prompt, response, config=config)],
                fragments=[parent(prompt, "q"), text_leaf("q", "steer this answer")],
            )
        )
        outs = await Collector(ws).until_complete(response, within=60)
    return outs[response].text


async def test_evergreen_struct_config_steers(live_server: Any) -> None:
    plain = await evergreen_turn(live_server, {"maxTokens": 10})
    steered = await evergreen_turn(live_server, {"maxTokens": 10, "steering": PUSH})
    camel = await evergreen_turn(
        live_server,
        {"maxTokens": 10, "steering": [{"concept": "concept1", "layer": 0, "scale": 60, "normMatch": False}]},
    )
    assert plain != steered and steered == camel
    async with websockets.connect(live_server.ws_url + "/evergreen", max_size=None) as ws:
        config = {"steering": [{"concept": "concept1", "layer": 7, "scale": 1}]}
        await ws.send(
            msg(actions=[generate("p", "r", config=config)], fragments=[parent("p", "q"), text_leaf("q", "x")])
        )
        code, reason = await closed_with(ws)
    assert code == 4400 and "INVALID_ARGUMENT" in reason and "layer 7" in reason, reason


def test_openai_takes_a_gated_entry_and_names_the_gate_field_it_refuses(live_server: Any) -> None:
    gate = {"concept": "concept0", "layer": 0, "comparison": "above", "threshold": 1e30}
    entry = {"concept": "concept1", "layer": 1, "scale": 60, "gate": gate}
    text = [
        r.json()["choices"][0]["message"]["content"]
        for r in (
            chat(live_server),
            chat(live_server, [entry]),
            chat(live_server, [{**entry, "gate": {**gate, "comparison": "below"}}]),
        )
    ]
    assert text[0] == text[1] != text[2]  # never open; always open after position 0
    cases = [
        ({**gate, "threshold": None}, "steering[0].gate.threshold must be a number"),
        ({**gate, "concept": "nope"}, "unknown gate concept 'nope'"),
        ({**gate, "layer": 5}, "gate layer 5 comes after the steered layer 1"),
        ({**gate, "comparison": "equal"}, "gate.comparison must be one of above, below"),
    ]
    for bad, message in cases:
        r = chat(live_server, [{**entry, "gate": bad}])
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "steering" and message in error["message"], (message, r.text)


async def test_evergreen_config_takes_a_gated_entry(live_server: Any) -> None:
    gate = {"concept": "concept0", "layer": 0, "comparison": "above", "threshold": 1e30}
    plain = await evergreen_turn(live_server, {"maxTokens": 10})
    never = await evergreen_turn(
        live_server, {"maxTokens": 10, "steering": [{"concept": "concept1", "layer": 1, "scale": 60, "gate": gate}]}
    )
    always = await evergreen_turn(
        live_server,
        {
            "maxTokens": 10,
            "steering": [{"concept": "concept1", "layer": 1, "scale": 60, "gate": {**gate, "comparison": "below"}}],
        },
    )
    assert plain == never != always
    async with websockets.connect(live_server.ws_url + "/evergreen", max_size=None) as ws:
        config = {"steering": [{"concept": "concept1", "layer": 1, "scale": 1, "gate": {**gate, "comparison": "over"}}]}
        await ws.send(
            msg(actions=[generate("p", "r", config=config)], fragments=[parent("p", "q"), text_leaf("q", "x")])
        )
        code, reason = await closed_with(ws)
    assert code == 4400 and "gate.comparison must be one of above, below" in reason, reason
