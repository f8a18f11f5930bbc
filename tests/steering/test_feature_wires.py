"""Steering by SAE feature on every wire, over real sockets: OpenAI, GraphPipe, Evergreen, salience.steering.v1.

One server: the tiny model, its pack (layers 0 and 1) and two random TopK SAEs, after layers 1
and 2 (256 features each). The engine's arithmetic is checked in test_feature_engine.py; here,
that each wire carries the same fields to it, and refuses what it must with a message naming them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from safetensors.torch import load_file

from prismgate.codecs.evergreen.actions import _steering_entry
from prismgate.core.budget import RequestBudget
from prismgate.core.steering import Comparison, Gate, SteeringEntry
from prismgate.schemas import evergreen_generate_pb2 as gpb
from prismgate.schemas import salience_steering_pb2 as steer_pb
from prismgate.schemas import salience_steering_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer, run_server, tiny_settings
from tests.graphpipe.helpers import infer_buffer, read_response
from tests.sae.saes import write_sae
from tests.salience.conftest import connect, rpc_error
from tests.steering.test_protocols import evergreen_turn

CLAMP = {"feature": 9, "layer": 2, "clamp": 6.0}


@pytest.fixture(scope="module")
def saes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("wire-saes")
    return [write_sae(root / "l1", layer=1, k=6, seed=11), write_sae(root / "l2", layer=2, k=6, seed=12)]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_pack: Path, saes: list[Path]) -> Iterator[LiveServer]:
    with run_server(tiny_settings(tiny_model_dir, tiny_pack, sae=",".join(map(str, saes)))) as srv:
        yield srv


def chat(server: LiveServer, steering: Any = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": "steer this answer"}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        **extra,
    }
    if steering is not None:
        body["steering"] = steering
    return httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=60)


def answer(response: httpx.Response) -> tuple[str, list[float]]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]


def test_openai_steers_by_feature_as_by_its_decoder_row(server: LiveServer, saes: list[Path]) -> None:
    row = load_file(str(saes[1] / "sae_weights.safetensors"))["W_dec"][9].tolist()
    plain = answer(chat(server))
    by_feature = answer(chat(server, [{"feature": 9, "layer": 2, "scale": 40}]))
    by_row = answer(chat(server, [{"direction": row, "layer": 2, "scale": 40}]))
    assert by_feature == by_row != plain
    clamped = answer(chat(server, [CLAMP]))
    assert clamped != plain
    # the features read after the clamped layer report the clamped stream
    asked = {"top_k": 4, "layers": [2]}
    after, before = (
        [t["layers"][0]["top"] for t in chat(server, s, features=asked).json()["choices"][0]["prismgate"]["features"]]
        for s in ([CLAMP], None)
    )
    assert after != before


def test_openai_gates_on_a_feature(server: LiveServer) -> None:
    gate = {"feature": 9, "layer": 1, "comparison": "above", "threshold": 1e30}
    entry = {"concept": "concept1", "layer": 1, "scale": 60, "gate": gate}
    plain, never = answer(chat(server)), answer(chat(server, [entry]))
    always = answer(chat(server, [{**entry, "gate": {**gate, "comparison": "below"}}]))
    assert plain == never != always


def test_openai_refuses_bad_feature_steering_naming_the_field(server: LiveServer) -> None:
    gate = {"feature": 3, "layer": 1, "comparison": "above", "threshold": 0}
    cases = [
        (
            [{"feature": 9, "layer": 0, "scale": 1}],
            "layer 0 has no SAE, so no feature 9 to steer by; the model's SAEs read after layers 1, 2",
        ),
        ([{"feature": 256, "layer": 2, "scale": 1}], "feature 256 is outside the SAE's features [0, 256) at layer 2"),
        ([{"feature": -1, "layer": 2, "scale": 1}], "steering[0].feature must be in [0, 2^31)"),
        ([{"feature": "9", "layer": 2, "scale": 1}], "steering[0].feature must be an integer"),
        ([{"feature": 9, "concept": "concept1", "layer": 1, "scale": 1}], "exactly one of the three"),
        ([{"feature": 9, "layer": 2, "scale": 1, "clamp": 2}], "a scale or (with a feature) a clamp, exactly one"),
        ([{"feature": 9, "layer": 2}], "a scale or (with a feature) a clamp, exactly one"),
        ([{"concept": "concept1", "layer": 1, "clamp": 2}], "it goes with a feature"),
        ([{**CLAMP, "clamp": 1e6}], "steering clamp must be in [-1000, 1000]"),
        ([{**CLAMP, "norm_match": True}], "takes no norm_match"),
        ([{**CLAMP, "gate": {**gate, "layer": 0}}], "gate: layer 0 has no SAE"),
        ([{**CLAMP, "gate": {**gate, "concept": "concept0"}}], "names a concept or a feature, not both"),
        ([{"direction": [1.0] * 128, "layer": 5, "scale": 1}], "layer 5 has neither a concept pack layer nor an SAE"),
    ]
    for steering, message in cases:
        r = chat(server, steering)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "steering" and message in error["message"], (message, r.text)
    # a direction at the SAE-only layer 2 steers (the feature entries' layer): accepted
    assert chat(server, [{"direction": [1.0] * 128, "layer": 2, "scale": 1}]).status_code == 200


def test_graphpipe_config_takes_a_feature_entry(server: LiveServer) -> None:
    def infer(config: dict[str, Any]) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
        body = infer_buffer([np.array(["steer a", "steer b"])], ["prompt"], ["tokens"], json.dumps(config))
        return read_response(httpx.post(server.http_url + "/graphpipe", content=body, timeout=60).content)

    (plain,), _ = infer({"max_tokens": 8})
    (steered,), _ = infer({"max_tokens": 8, "steering": [CLAMP]})
    assert plain.shape == steered.shape and (plain != steered).any(axis=1).all()
    _, errors = infer({"steering": [{**CLAMP, "feature": 999}]})
    assert errors and errors[0]["code"] == 3 and b"feature 999 is outside" in errors[0]["message"]


async def test_evergreen_struct_config_takes_feature_entries(server: LiveServer) -> None:
    plain = await evergreen_turn(server, {"maxTokens": 10})
    clamped = await evergreen_turn(server, {"maxTokens": 10, "steering": [CLAMP]})
    gate = {"feature": 9, "layer": 1, "comparison": "above", "threshold": 1e30}
    never = await evergreen_turn(
        server, {"maxTokens": 10, "steering": [{"concept": "concept1", "layer": 1, "scale": 60, "gate": gate}]}
    )
    assert plain != clamped and plain == never


def test_evergreen_binary_config_reads_the_new_fields() -> None:
    budget = RequestBudget()
    entry = _steering_entry(gpb.SteeringEntry(feature=9, layer=2, clamp=6.0), 0, budget)
    assert entry == SteeringEntry(layer=2, scale=0.0, feature=9, clamp=6.0)
    gated = gpb.SteeringEntry(
        concept="concept1",
        layer=1,
        scale=4,
        gate=gpb.SteeringGate(feature=3, layer=1, comparison="below", threshold=0.5),
    )
    assert _steering_entry(gated, 0, budget).gate == Gate(None, 1, Comparison.BELOW, 0.5, feature=3)
    # an unset clamp is no clamp (proto3 optional), and a scale beside a clamp is refused
    assert _steering_entry(gpb.SteeringEntry(feature=9, layer=2, scale=3), 0, budget).clamp is None
    with pytest.raises(Exception, match=r"config.steering\[0\]: a steering entry has a scale or a clamp, not both"):
        _steering_entry(gpb.SteeringEntry(feature=9, layer=2, scale=3, clamp=1.0), 0, budget)


def test_salience_steering_companion_sets_feature_entries(server: LiveServer) -> None:
    client = connect(server.grpc_target)
    stub = salience_steering_pb2_grpc.SteeringStub(client.channel)
    prompt = [5, 17, 42, 99, 7, 3]

    def greedy(session: str) -> list[int]:
        tokens, _ = client.generate(session_id=session, offset=0, append_tokens=prompt, max_tokens=10, top_k=1)
        return [t.id for t in tokens if not t.is_prefill]

    try:
        plain = greedy(client.open())
        session = client.open()
        clamp = steer_pb.SteeringEntry(feature=9, layer=2, clamp=6.0, positions=steer_pb.POSITIONS_BOTH)
        gated = steer_pb.SteeringEntry(
            concept="concept1",
            layer=1,
            scale=60,
            positions=steer_pb.POSITIONS_BOTH,
            gate=steer_pb.Gate(feature=9, layer=1, comparison=steer_pb.COMPARISON_ABOVE, threshold=1e30),
        )
        echoed = stub.SetSteering(steer_pb.SetSteeringRequest(session_id=session, entries=[clamp, gated])).entries
        assert list(echoed) == [clamp, gated]
        got = stub.GetSteering(steer_pb.GetSteeringRequest(session_id=session)).entries
        assert list(got) == [clamp, gated] and got[0].HasField("clamp") and got[1].gate.HasField("feature")
        steered = greedy(session)
        # the same steering over OpenAI (on the prompt as tokens): the same greedy answer
        body = {"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 10, "temperature": 0}
        gate = {"feature": 9, "layer": 1, "comparison": "above", "threshold": 1e30}
        steering = [CLAMP, {"concept": "concept1", "layer": 1, "scale": 60, "gate": gate}]
        openai = httpx.post(server.http_url + "/v1/completions", json={**body, "steering": steering}, timeout=60)
        assert openai.status_code == 200, openai.text
        tokenizer = server.service.info().tokenizer
        assert steered != plain and openai.json()["choices"][0]["text"] == tokenizer.decode(steered)
        bad = steer_pb.SteeringEntry(feature=9, layer=0, scale=1)
        error = rpc_error(stub.SetSteering, steer_pb.SetSteeringRequest(session_id=session, entries=[bad]))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "layer 0 has no SAE" in error.details()
    finally:
        client.channel.close()
