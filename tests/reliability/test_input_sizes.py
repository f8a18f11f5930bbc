"""Issue 23, items 2 and 3: numbers a client sends, checked against the model before they are converted.

Each hostile input goes over a real socket inside :class:`~tests.reliability.conftest.UnderAttack`
(``/healthz`` probed, a victim served, RSS watched). The inputs are built before the watch
starts: the client shares this process, and its own copy of a 30 MB body is not the
server's growth. Every wire that carries a steering ``direction`` (or a generic JSON or
Struct value that could hold millions of numbers) refuses it by its size, naming what it
measured, before a parser or a copy turns it into millions of Python objects.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import requests
import websockets

from prismgate.schemas import evergreen_pb2 as epb
from prismgate.schemas import evergreen_pb2_grpc, salience_pb2_grpc, salience_steering_pb2_grpc
from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_steering_pb2 as steer_pb
from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.evergreen.wire import STRUCT, generate, msg, text_leaf, uid
from tests.graphpipe.helpers import infer_buffer, read_response
from tests.reliability.conftest import UnderAttack

HIDDEN = 128  # the tiny model's hidden size
MILLIONS = 5_000_000  # numbers in one hostile list: 25 MB of JSON, 40 MB of doubles, 55 MB of Struct
RSS_LIMIT_MB = 100.0  # the target for each of these inputs
# over gRPC a 40-55 MB message is, for a moment, several copies in this process: the client's
# send buffers, and the server's received slices, their bytes and the decoded message (grpc's
# own; the gateway refuses it without copying out a number); freed memory stays in malloc's arenas
GRPC_RSS_LIMIT_MB = 300.0


@pytest.fixture(scope="module")
def server(server_factory: Any) -> Iterator[LiveServer]:
    with server_factory() as live:
        yield live


def numbers_json(count: int) -> str:
    """``[0.5, 0.5, ...]`` as JSON text, built without a list of ``count`` Python floats."""
    return "[0.5" + ", 0.5" * (count - 1) + "]"


def steering_json(count: int) -> str:
    return '[{"direction": ' + numbers_json(count) + ', "layer": 0, "scale": 4}]'


# -- item 2: every wire refuses a direction of millions of numbers before reading it --------------


def test_openai_body_with_a_direction_of_millions(server: LiveServer) -> None:
    head = json.dumps({"model": TINY_MODEL_ID, "prompt": "hi", "max_tokens": 2})[:-1]
    body = (head + ', "steering": ' + steering_json(MILLIONS) + "}").encode()
    with UnderAttack(server.http_url, rss_limit_mb=RSS_LIMIT_MB):
        for _ in range(2):
            reply = httpx.post(server.http_url + "/v1/completions", content=body, timeout=60)
            assert reply.status_code == 400, reply.text[:300]
            assert "JSON values" in reply.json()["error"]["message"], reply.text[:300]


async def evergreen_closed(server: LiveServer, frame: str) -> tuple[int, str]:
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        await ws.send(frame)
        try:
            async with asyncio.timeout(60):
                while True:
                    await ws.recv()
        except websockets.ConnectionClosed as exc:
            assert exc.rcvd is not None
            return exc.rcvd.code, exc.rcvd.reason


@pytest.mark.parametrize("key", ["steering", "unknownKey"])
async def test_evergreen_json_struct_config_of_millions(server: LiveServer, key: str) -> None:
    """A Struct config whose bulk is a steering direction, or a list under a key no config has."""
    prompt = uid()
    config = {"maxTokens": 2, key: "@@"}
    value = steering_json(MILLIONS) if key == "steering" else numbers_json(MILLIONS)
    frame = msg(actions=[generate(prompt, uid(), config=config)], fragments=[text_leaf(prompt, "hi")])
    frame = frame.replace('"@@"', value)
    with UnderAttack(server.http_url, rss_limit_mb=RSS_LIMIT_MB):
        code, reason = await evergreen_closed(server, frame)
        assert code == 4400 and "JSON values" in reason, (code, reason)


def struct_of_numbers(key: str, count: int) -> bytes:
    """A google.protobuf.Struct ``{key: [0.5] * count}`` in protobuf binary, built at C speed."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte, n = n & 0x7F, n >> 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)

    def field(number: int, payload: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    number = b"\x11" + struct.pack("<d", 0.5)  # Value.number_value
    items = (b"\x0a" + varint(len(number)) + number) * count  # ListValue.values
    value = field(6, items)  # Value.list_value
    return field(1, field(1, key.encode()) + field(2, value))  # Struct.fields map entry


@pytest.mark.parametrize("key", ["steering", "unknown_key"])
def test_evergreen_grpc_struct_config_of_millions(server: LiveServer, key: str) -> None:
    message = epb.SessionMessage()
    action = message.actions.add(name="GENERATE")
    action.inputs.add(name="prompt", id="p")
    action.outputs.add(name="response", id="r")
    action.configs.add(type_url=STRUCT, value=struct_of_numbers(key, MILLIONS))
    message.node_fragments.add(id="p", child_ids=["q"])
    leaf = message.node_fragments.add(id="q")
    leaf.chunk_fragment.metadata.mimetype = "text/plain"
    leaf.chunk_fragment.data = b"hi"
    with (
        UnderAttack(server.http_url, rss_limit_mb=GRPC_RSS_LIMIT_MB),
        grpc.insecure_channel(server.grpc_target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel,
    ):
        stub = evergreen_pb2_grpc.EvergreenServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.StartSession(iter([message]), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "config is" in refused.value.details() and "bytes" in refused.value.details()


def test_graphpipe_config_with_a_direction_of_millions(server: LiveServer) -> None:
    config = '{"max_tokens": 2, "steering": ' + steering_json(MILLIONS) + "}"
    body = infer_buffer([np.array(["hi"])], ["prompt"], ["tokens"], config)
    del config
    with UnderAttack(server.http_url, rss_limit_mb=RSS_LIMIT_MB):
        reply = requests.post(server.http_url + "/graphpipe", data=body, timeout=60)
        _, errors = read_response(reply.content)
        assert errors and errors[0]["code"] == 3 and b"JSON values" in errors[0]["message"], errors


def test_salience_set_steering_with_a_direction_of_millions(server: LiveServer) -> None:
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(server.grpc_target, options=options) as channel:
        session = salience_pb2_grpc.SalienceStub(channel).OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID))
        entry = steer_pb.SteeringEntry(layer=0, scale=4)
        entry.direction.extend(np.full(MILLIONS, 0.5))
        request = steer_pb.SetSteeringRequest(session_id=session.session_id, entries=[entry]).SerializeToString()
        del entry
        # the request's bytes as they are: the client's serializing is not the server's memory
        set_steering = channel.unary_unary("/salience.steering.v1.Steering/SetSteering", lambda b: b, lambda b: b)
        with UnderAttack(server.http_url, rss_limit_mb=GRPC_RSS_LIMIT_MB):
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    set_steering(request, timeout=60)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"{MILLIONS} numbers" in refused.value.details(), refused.value.details()
                assert f"at most {HIDDEN}" in refused.value.details(), refused.value.details()


# -- item 3: numbers whose squares underflow or overflow are still directions ---------------------

EXTREMES = [1e-200, 1.2e154, 1e200, 5e-324]


def test_extreme_directions_steer_as_their_unit_vector_on_every_wire(server: LiveServer) -> None:
    """``[x] * hidden`` for any finite x != 0 is the direction of ``[1] * hidden``: the same text, never a 500."""

    def completion(value: float) -> str:
        steering = [{"direction": [value] * HIDDEN, "layer": 0, "scale": 60}]
        body = {"model": TINY_MODEL_ID, "prompt": "steer this", "max_tokens": 6, "temperature": 0}
        reply = httpx.post(server.http_url + "/v1/completions", json={**body, "steering": steering}, timeout=60)
        assert reply.status_code == 200, (value, reply.text)
        return str(reply.json()["choices"][0]["text"])

    def graphpipe(value: float) -> list[int]:
        config = json.dumps({"max_tokens": 6, "steering": [{"direction": [value] * HIDDEN, "layer": 0, "scale": 60}]})
        reply = requests.post(
            server.http_url + "/graphpipe",
            data=infer_buffer([np.array(["steer this"])], ["prompt"], ["tokens"], config),
            timeout=60,
        )
        outputs, errors = read_response(reply.content)
        assert not errors, (value, errors)
        return [int(x) for x in outputs[0].ravel()]

    with UnderAttack(server.http_url):
        want, want_rows = completion(1.0), graphpipe(1.0)
        plain = httpx.post(
            server.http_url + "/v1/completions",
            json={"model": TINY_MODEL_ID, "prompt": "steer this", "max_tokens": 6, "temperature": 0},
            timeout=60,
        ).json()["choices"][0]["text"]
        assert want != plain  # the direction does steer
        for value in EXTREMES:
            assert completion(value) == want, value
            assert graphpipe(value) == want_rows, value


async def test_extreme_directions_over_evergreen(server: LiveServer) -> None:
    async def run(value: float) -> str:
        prompt, response = uid(), uid()
        config = {"maxTokens": 4, "steering": [{"direction": [value] * HIDDEN, "layer": 0, "scale": 60}]}
        frame = msg(actions=[generate(prompt, response, config=config)], fragments=[text_leaf(prompt, "steer")])
        async with websockets.connect(server.ws_url + "/evergreen") as ws:
            await ws.send(frame)
            got = b""
            async with asyncio.timeout(60):
                while True:
                    reply = json.loads(await ws.recv())
                    for f in reply.get("nodeFragments", []):
                        if f["id"] == response:
                            got += base64.b64decode(f.get("chunkFragment", {}).get("data", ""))
                            if not f.get("continued"):
                                return got.decode()

    with UnderAttack(server.http_url):
        want = await run(1.0)
        for value in EXTREMES:
            assert await run(value) == want, value


def test_salience_set_steering_with_extreme_numbers_leaves_the_session_usable(server: LiveServer) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel, UnderAttack(server.http_url):
        salience = salience_pb2_grpc.SalienceStub(channel)
        steering = salience_steering_pb2_grpc.SteeringStub(channel)

        def steered(value: float) -> list[int]:
            sid = salience.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
            entry = steer_pb.SteeringEntry(layer=0, scale=60, direction=[value] * HIDDEN)
            steering.SetSteering(steer_pb.SetSteeringRequest(session_id=sid, entries=[entry]), timeout=10)
            out = []
            for turn in range(2):  # a second turn too: the session stays usable
                request = spb.GenerateRequest(
                    session_id=sid, offset=6 * turn, append_tokens=[5, 17, 42], max_tokens=3, top_k=1
                )
                events = list(salience.Generate(request, timeout=30))
                assert events[-1].WhichOneof("event") == "done", value
                out += [e.token.id for e in events[:-1]]
            salience.CloseSession(spb.CloseSessionRequest(session_id=sid))
            return out

        want = steered(1.0)
        for value in EXTREMES:
            assert steered(value) == want, value


# -- item 5: an error quotes a client's string in part, on every wire ------------------------------

LONG = "m" * 1_000_000


def test_a_megabyte_model_name_or_session_id_is_quoted_in_part(server: LiveServer) -> None:
    with UnderAttack(server.http_url):
        reply = httpx.post(
            server.http_url + "/v1/completions", json={"model": LONG, "prompt": "hi", "max_tokens": 1}, timeout=30
        )
        assert reply.status_code == 404 and len(reply.content) < 1000, len(reply.content)
        assert "(1000000 characters)" in reply.json()["error"]["message"]
        options = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(server.grpc_target, options=options) as channel:
            stub = salience_pb2_grpc.SalienceStub(channel)
            for call in (
                lambda: stub.OpenSession(spb.OpenSessionRequest(model=LONG), timeout=30),
                lambda: stub.DumpSession(spb.DumpSessionRequest(session_id=LONG), timeout=30),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                # not RESOURCE_EXHAUSTED "Stream removed": the trailer fits the metadata limit
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value
                details = refused.value.details() or ""
                assert len(details) < 1000 and "(1000000 characters)" in details, details[:300]
