"""Fuzz every decoder against a live server: random and mutated inputs on real sockets.

For each protocol a fixed seed drives a bounded number of cases built by mutating valid
messages (bit flips, truncation, splices, nasty words, structural JSON edits) and by
generating random ones. Every case must end within a time limit (no hang) with either a
normal answer or a clear rejection: a gRPC status with details, a WebSocket close with an
application code and a reason, a GraphPipe error with a message. Afterwards the server is
healthy and nothing is left running.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import random
import struct
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import websockets
from graphpipe import convert

from prismgate.schemas import evergreen_generate_pb2 as gpb
from prismgate.schemas import evergreen_pb2 as epb
from prismgate.schemas import salience_pb2 as spb
from tests.conftest import TINY_MODEL_ID
from tests.reliability.conftest import assert_healthy

SEED = 20240917
CASES = 250  # per decoder; each case is one request or connection
CASE_TIMEOUT_S = 15.0

# -- byte mutations ------------------------------------------------------------------------


def mutate_bytes(rng: random.Random, buf: bytes) -> bytes:
    data = bytearray(buf)
    kind = rng.randrange(8)
    if kind == 0 or not data:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 128)))
    if kind == 1:
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 2:
        at = rng.randrange(len(data)) & ~3
        word = rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, len(data), rng.getrandbits(32)])
        data[at : at + 4] = struct.pack("<I", word)[: len(data) - at]
    elif kind == 3:
        del data[rng.randrange(len(data)) :]
    elif kind == 4:
        at = rng.randrange(len(data) + 1)
        data[at:at] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 24)))
    elif kind == 5:  # a run of 0xff: varints that never end, huge lengths
        at = rng.randrange(len(data))
        data[at : at + 10] = b"\xff" * 10
    elif kind == 6:
        at = rng.randrange(len(data)) & ~7
        data[at : at + 8] = struct.pack("<q", rng.choice([-1, 0, 2**31, 2**62, -(2**63)]))[: len(data) - at]
    else:  # duplicate a slice (repeated fields, repeated tables)
        a = rng.randrange(len(data))
        b = min(len(data), a + rng.randint(1, 32))
        data[b:b] = data[a:b] * rng.randint(1, 4)
    return bytes(data)


def mutated(rng: random.Random, seeds: list[bytes]) -> bytes:
    buf = rng.choice(seeds)
    for _ in range(rng.randint(1, 3)):
        buf = mutate_bytes(rng, buf)
    return buf


# -- JSON mutations (Evergreen text frames) -------------------------------------------------


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, 2**64, -(2**63), 10**30])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e308, 3.14])
    if kind == 4:
        return rng.choice(
            ["", "x", "GENERATE", "prompt", "response", "text/plain", "\u0000", "é" * 50, "%%%", "a" * 300]
        )
    if kind == 5:
        return base64.b64encode(bytes(rng.getrandbits(8) for _ in range(rng.randrange(16)))).decode()
    if kind == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["id", "seq", "continued", "chunkFragment", "childIds", "actions", "nodeFragments", "name", "inputs"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def mutate_json(rng: random.Random, value: Any) -> Any:
    """Replace, drop or duplicate one randomly chosen place in a JSON document."""
    value = copy.deepcopy(value)
    paths: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k in node:
                paths.append((node, k))
                walk(node[k])
        elif isinstance(node, list):
            for i in range(len(node)):
                paths.append((node, i))
                walk(node[i])

    walk(value)
    if not paths:
        return random_json(rng)
    container, key = rng.choice(paths)
    action = rng.randrange(3)
    if action == 0:
        container[key] = random_json(rng)
    elif action == 1 and isinstance(container, dict):
        del container[key]
    elif action == 1:
        container.pop(key)
    elif isinstance(container, list):
        container.append(copy.deepcopy(container[key]))
    else:
        container[key + "X" if isinstance(key, str) else key] = copy.deepcopy(container[key])
    return value


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def evergreen_json_seeds() -> list[dict]:
    struct_config = {"@type": "type.googleapis.com/google.protobuf.Struct", "value": {"maxTokens": 2}}
    generate = {
        "name": "GENERATE",
        "inputs": [{"name": "prompt", "id": "p"}],
        "outputs": [{"name": "response", "id": "r"}, {"name": "usage", "id": "u"}],
        "configs": [struct_config],
    }
    return [
        {
            "actions": [generate],
            "nodeFragments": [
                {"id": "p", "childIds": ["q", "e"]},
                {
                    "id": "q",
                    "chunkFragment": {"metadata": {"mimetype": "text/plain", "role": "user"}, "data": b64("Hi")},
                },
                {"id": "e", "chunkFragment": {"metadata": {"mimetype": "application/x-protobuf; type=EndOfTurn"}}},
            ],
        },
        {
            "nodeFragments": [
                {"id": "a", "seq": 0, "continued": True, "chunkFragment": {"metadata": {"mimetype": "text/plain"}}},
                {"id": "a", "seq": 1, "chunkFragment": {"data": b64("two")}},
            ],
            "actions": [{"name": "DROP", "inputs": [{"name": "node", "id": "a"}]}],
        },
        {"actions": [{"name": "CANCEL", "inputs": [{"name": "output", "id": "r"}]}]},
    ]


def evergreen_binary_seeds() -> list[bytes]:
    out = []
    message = epb.SessionMessage()
    action = message.actions.add(name="GENERATE")
    action.inputs.add(name="prompt", id="p")
    action.outputs.add(name="response", id="r")
    action.configs.add().Pack(gpb.GenerateConfig(max_tokens=2, top_logprobs=2))
    message.node_fragments.add(id="p", child_ids=["q"])
    leaf = message.node_fragments.add(id="q")
    leaf.chunk_fragment.metadata.mimetype = "text/plain"
    leaf.chunk_fragment.data = b"Hello"
    out.append(message.SerializeToString())
    other = epb.SessionMessage()
    frag = other.node_fragments.add(id="n", seq=3, continued=True)
    frag.chunk_fragment.metadata.mimetype = "image/png"
    frag.chunk_fragment.data = bytes(range(64))
    out.append(other.SerializeToString())
    return out


# -- GraphPipe ----------------------------------------------------------------------------------


def graphpipe_seeds() -> list[bytes]:
    def infer(inputs: list[np.ndarray], names: list[str] | None, outs: list[str] | None, config: str | None) -> bytes:
        return bytes(convert.serialize_infer_request(convert.InferReq(config, inputs, names, outs)))

    cfg = '{"max_tokens": 2, "logprobs": 2}'
    return [
        bytes(convert.serialize_metadata_request()),
        infer([np.array(["hello", "wörld"])], ["prompt"], ["text", "tokens", "lengths"], cfg),
        infer([np.array([[1, 2, 3], [4, 5, -1]], dtype=np.int64)], ["tokens"], ["readouts", "top_logprobs"], cfg),
        infer([np.array([7, 8], dtype=np.int32)], None, ["logprobs"], '{"max_tokens": 1, "stop": ["a"]}'),
    ]


def check_graphpipe_answer(status: int, body: bytes) -> str:
    """'ok', or the error message; fails the test when the answer is not a clear one."""
    assert status < 500 or body, f"HTTP {status} with an empty body"
    if status != 200:
        assert 400 <= status < 600
        assert body.strip(), f"HTTP {status} without a message"
        return body.decode(errors="replace")
    try:
        outputs, errors = convert.deserialize_infer_response(body)
    except Exception:
        return "ok"  # a MetadataResponse (what a non-infer request gets)
    if errors:
        message = errors[0]["message"] if isinstance(errors[0], dict) else str(errors[0])
        assert message, "a GraphPipe error without a message"
        return str(message)
    assert outputs is not None
    return "ok"


def test_fuzz_graphpipe_flatbuffers(live_server: Any) -> None:
    rng = random.Random(SEED)
    seeds = graphpipe_seeds()
    answers: dict[str, int] = {"ok": 0, "error": 0}
    with httpx.Client(timeout=CASE_TIMEOUT_S) as http:
        for i in range(CASES):
            body = mutated(rng, seeds) if i % 8 else bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 64)))
            response = http.post(live_server.http_url + "/graphpipe", content=body)
            verdict = check_graphpipe_answer(response.status_code, response.content)
            answers["ok" if verdict == "ok" else "error"] += 1
    assert answers["error"] > CASES // 4, f"the mutations should mostly be rejected: {answers}"
    assert_healthy(live_server)


# -- Evergreen ----------------------------------------------------------------------------------


async def evergreen_case(url: str, frame: str | bytes) -> tuple[int, str]:
    """Send one fuzzed frame, then a frame that is always invalid; return the close (code, reason).

    The second frame bounds the case: whatever the first did, the session must end with a
    clear abort (or have ended already, with one).
    """
    async with websockets.connect(url, max_size=None, open_timeout=CASE_TIMEOUT_S) as ws:
        await ws.send(frame)
        await ws.send(b"\xff\x00 definitely not a SessionMessage" if isinstance(frame, bytes) else "{not json")
        async with asyncio.timeout(CASE_TIMEOUT_S):
            try:
                while True:
                    await ws.recv()
            except websockets.ConnectionClosed as exc:
                assert exc.rcvd is not None, "closed without a close frame"
                return exc.rcvd.code, exc.rcvd.reason


def assert_clear_close(code: int, reason: str) -> None:
    assert 4400 <= code <= 4599, f"close code {code} ({reason!r}) is not an application error code"
    assert reason and ":" in reason, f"close reason {reason!r} names no code and message"


async def test_fuzz_evergreen_json_frames(live_server: Any) -> None:
    rng = random.Random(SEED + 1)
    seeds = evergreen_json_seeds()
    url = live_server.ws_url + "/evergreen"
    codes: dict[int, int] = {}
    for i in range(CASES):
        if i % 10 == 0:
            frame = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)])) for _ in range(40))
        elif i % 10 == 1:
            frame = json.dumps(random_json(rng))
        else:
            doc = rng.choice(seeds)
            for _ in range(rng.randint(1, 3)):
                doc = mutate_json(rng, doc)
            frame = json.dumps(doc)
        code, reason = await evergreen_case(url, frame)
        assert_clear_close(code, reason)
        codes[code] = codes.get(code, 0) + 1
    assert len(codes) >= 2, f"expected several kinds of rejection, got {codes}"
    await asyncio.to_thread(assert_healthy, live_server)


async def test_fuzz_evergreen_protobuf_frames(live_server: Any) -> None:
    rng = random.Random(SEED + 2)
    seeds = evergreen_binary_seeds()
    url = live_server.ws_url + "/evergreen"
    for _ in range(CASES):
        code, reason = await evergreen_case(url, mutated(rng, seeds))
        assert_clear_close(code, reason)
    await asyncio.to_thread(assert_healthy, live_server)


def test_fuzz_evergreen_grpc_stream(live_server: Any) -> None:
    """Raw bytes on evergreen.v2 StartSession: each stream ends with a non-OK status and details."""
    rng = random.Random(SEED + 3)
    seeds = evergreen_binary_seeds()
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        start = channel.stream_stream(
            "/evergreen.v2.EvergreenService/StartSession",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        for _ in range(CASES // 4):
            frames = [mutated(rng, seeds), b"\xff\xff\xff"]  # the second never parses: bounds the stream
            call = start(iter(frames), timeout=CASE_TIMEOUT_S)
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert info.value.details(), "a status without details"
    assert_healthy(live_server)


# -- Salience -----------------------------------------------------------------------------------


def salience_seeds(session_id: str) -> list[bytes]:
    requests = [
        spb.GenerateRequest(session_id=session_id, offset=0, append_tokens=[72, 105, 33], max_tokens=2, top_k=1),
        spb.GenerateRequest(
            session_id=session_id,
            offset=0,
            append_tokens=[1, 2, 3, 4],
            max_tokens=1,
            logprobs_ranges=[spb.PositionRange(start=0, end=5)],
            logprob_top_k=3,
            readout_ranges=[spb.PositionRange(start=1, end=5)],
            temperature=0.7,
            top_p=0.9,
            stop_token_ids=[5],
        ),
    ]
    return [r.SerializeToString() for r in requests]


def random_generate(rng: random.Random, session_id: str) -> spb.GenerateRequest:
    """A well-formed message with hostile values."""
    big = [0, 1, 2**31, 2**32 - 1, rng.randrange(600)]
    return spb.GenerateRequest(
        session_id=rng.choice([session_id, "", "nope", "x" * 1000]),
        offset=rng.choice(big),
        truncating=rng.random() < 0.3,
        append_tokens=[rng.choice([*big, rng.randrange(300)]) for _ in range(rng.randrange(6))],
        max_tokens=rng.choice([0, 1, 3, 2**32 - 1]),
        logprobs_ranges=[
            spb.PositionRange(start=rng.choice(big), end=rng.choice(big)) for _ in range(rng.randrange(3))
        ],
        logprob_top_k=rng.choice([0, 5, 21, 2**31]),
        readout_ranges=[spb.PositionRange(start=rng.choice(big), end=rng.choice(big)) for _ in range(rng.randrange(3))],
        temperature=rng.choice([0.0, 0.5, -1.0, float("nan"), float("inf"), 1e30]),
        top_p=rng.choice([0.0, 0.5, 1.0, -0.5, 2.0, float("nan")]),
        top_k=rng.choice([0, 1, 2**32 - 1]),
        stop_token_ids=[rng.choice(big) for _ in range(rng.randrange(3))],
        priority=rng.choice([0, -(2**31), 2**31 - 1]),
    )


def test_fuzz_salience_requests(live_server: Any) -> None:
    rng = random.Random(SEED + 4)
    statuses: dict[str, int] = {}
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        raw_generate = channel.unary_stream(
            "/salience.v1.Salience/Generate",
            request_serializer=lambda b: b,
            response_deserializer=spb.GenerateEvent.FromString,
        )
        unary: dict[str, Callable[..., Any]] = {
            name: channel.unary_unary(
                f"/salience.v1.Salience/{name}", request_serializer=lambda b: b, response_deserializer=lambda b: b
            )
            for name in ("OpenSession", "ForkSession", "CloseSession", "DumpSession", "GetReadoutManifest")
        }
        open_session = channel.unary_unary(
            "/salience.v1.Salience/OpenSession",
            request_serializer=spb.OpenSessionRequest.SerializeToString,
            response_deserializer=spb.OpenSessionResponse.FromString,
        )
        close_session = channel.unary_unary(
            "/salience.v1.Salience/CloseSession",
            request_serializer=spb.CloseSessionRequest.SerializeToString,
            response_deserializer=lambda b: b,
        )
        for i in range(CASES):
            sid = open_session(spb.OpenSessionRequest(model=TINY_MODEL_ID), timeout=CASE_TIMEOUT_S).session_id
            kind = i % 3
            try:
                if kind == 0:
                    events = list(raw_generate(mutated(rng, salience_seeds(sid)), timeout=CASE_TIMEOUT_S))
                elif kind == 1:
                    events = list(raw_generate(random_generate(rng, sid).SerializeToString(), timeout=CASE_TIMEOUT_S))
                else:
                    name = rng.choice(list(unary))
                    unary[name](
                        mutated(
                            rng,
                            [
                                spb.ForkSessionRequest(session_id=sid, at_position=0).SerializeToString(),
                                spb.OpenSessionRequest(model=TINY_MODEL_ID).SerializeToString(),
                            ],
                        ),
                        timeout=CASE_TIMEOUT_S,
                    )
                    events = None
                if events is not None:
                    assert events and events[-1].WhichOneof("event") == "done", "an OK stream must end with Done"
                statuses["OK"] = statuses.get("OK", 0) + 1
            except grpc.RpcError as exc:
                code = exc.code()
                assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, "the server hung on a fuzzed request"
                assert exc.details(), f"{code} without details"
                assert code is not grpc.StatusCode.UNKNOWN, exc.details()  # every rejection has a real status
                statuses[code.name] = statuses.get(code.name, 0) + 1
            close_session(spb.CloseSessionRequest(session_id=sid), timeout=CASE_TIMEOUT_S)
    assert len(statuses) >= 3, f"expected several outcomes, got {statuses}"
    assert_healthy(live_server)


def test_corrupt_salience_request_is_invalid_argument(live_server: Any) -> None:
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        generate = channel.unary_stream(
            "/salience.v1.Salience/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as info:
            list(
                generate(b"\x0a\xff\xff\xff\xff\xff", timeout=CASE_TIMEOUT_S)
            )  # a string field longer than the message
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    assert "not a valid protobuf message" in info.value.details()
