"""Limits hold: oversized messages, too many sessions, too deep node trees, file refs outside the root.

Each is rejected with a clear error on the protocol that hit it, and the server carries on.
One server with small limits serves the whole module.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import websockets
from graphpipe import convert

from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.reliability.conftest import assert_healthy

MAX_MESSAGE = 256 * 1024
MAX_BODY = 64 * 1024
MAX_SESSIONS = 3
MAX_DEPTH = 4


@pytest.fixture(scope="module")
def file_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("refs")
    root = base / "allowed"
    root.mkdir()
    (root / "hello.txt").write_text("Hello from a file.")
    (base / "secret.txt").write_text("outside the root")
    os.symlink(base / "secret.txt", root / "link.txt")  # inside the root, pointing out of it
    return root


@pytest.fixture(scope="module")
def limited(server_factory: Any, file_root: Path) -> Iterator[LiveServer]:
    with server_factory(
        grpc_max_message_bytes=MAX_MESSAGE,
        graphpipe_max_body_bytes=MAX_BODY,
        max_sessions=MAX_SESSIONS,
        evergreen_max_depth=MAX_DEPTH,
        evergreen_file_root=str(file_root),
    ) as server:
        yield server


async def ws_outcome(server: LiveServer, message: str | bytes, within: float = 30.0) -> tuple[int, str, list[Any]]:
    """Send one message; read until the server closes (or, for a healthy session, until ``usage`` arrives)."""
    frames: list[Any] = []
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        try:
            await ws.send(message)  # a refused session may be closed before this lands
            async with asyncio.timeout(within):
                while True:
                    frame = await ws.recv()
                    frames.append(frame)
                    fragments = json.loads(frame).get("nodeFragments", [])
                    if any(f["id"] == "u" and not f.get("continued") for f in fragments):
                        return 1000, "", frames  # the answer's usage arrived complete: a healthy session
        except websockets.ConnectionClosed as exc:
            assert exc.rcvd is not None, "closed without a close frame"
            return exc.rcvd.code, exc.rcvd.reason, frames


def text_generate(leaves: list[dict], root_children: list[str], extra: list[dict] | None = None) -> str:
    return json.dumps(
        {
            "actions": [
                {
                    "name": "GENERATE",
                    "inputs": [{"name": "prompt", "id": "p"}],
                    "outputs": [{"name": "response", "id": "r"}, {"name": "usage", "id": "u"}],
                    "configs": [{"@type": "type.googleapis.com/google.protobuf.Struct", "value": {"maxTokens": 2}}],
                }
            ],
            "nodeFragments": [{"id": "p", "childIds": root_children}, *leaves, *(extra or [])],
        }
    )


def ref_leaf(node_id: str, ref: str) -> dict:
    return {"id": node_id, "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "ref": ref}}


# -- oversized messages ----------------------------------------------------------------------------


def test_oversized_messages_are_refused_on_every_protocol(limited: LiveServer) -> None:
    # Salience: a GenerateRequest over grpc_max_message_bytes
    with grpc.insecure_channel(limited.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
        huge = spb.GenerateRequest(session_id=sid, offset=0, append_tokens=[200] * (MAX_MESSAGE // 2), max_tokens=1)
        assert huge.ByteSize() > MAX_MESSAGE
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(huge, timeout=30))
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.details()
        assert list(stub.DumpSession(spb.DumpSessionRequest(session_id=sid)).tokens) == []
        stub.CloseSession(spb.CloseSessionRequest(session_id=sid))

    # GraphPipe: a body over graphpipe_max_body_bytes, refused with an error naming the limit
    body = bytes(
        convert.serialize_infer_request(
            convert.InferReq('{"max_tokens": 1}', [np.array(["x" * (2 * MAX_BODY)])], ["prompt"], ["text"])
        )
    )
    r = httpx.post(limited.http_url + "/graphpipe", content=body, timeout=30)
    _, errors = convert.deserialize_infer_response(r.content)
    message = errors[0]["message"] if errors else b""
    message = message.decode() if isinstance(message, bytes) else message
    assert errors[0]["code"] == 8 and str(MAX_BODY) in message, errors
    r = httpx.post(
        limited.http_url + "/graphpipe", content=body, timeout=30, headers={"User-Agent": "Go-http-client/1.1"}
    )
    assert r.status_code == 413 and r.text

    # Evergreen: a WebSocket frame over the message limit closes with 1009 (message too big)
    big = text_generate(
        [
            {
                "id": "q",
                "chunkFragment": {
                    "metadata": {"mimetype": "text/plain"},
                    "data": base64.b64encode(b"x" * MAX_MESSAGE).decode(),
                },
            }
        ],
        ["q"],
    )
    code, _, _ = asyncio.run(ws_outcome(limited, big))
    assert code == 1009
    assert_healthy(limited)


# -- too many sessions --------------------------------------------------------------------------


def test_too_many_sessions_are_refused_on_every_protocol(limited: LiveServer) -> None:
    store = limited.service.store
    with grpc.insecure_channel(limited.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        free = MAX_SESSIONS - len(store)
        ids = [stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id for _ in range(free)]
        try:
            refused_everywhere(limited, stub)
        finally:
            for sid in ids:
                stub.CloseSession(spb.CloseSessionRequest(session_id=sid))
        again = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id  # room again
        stub.CloseSession(spb.CloseSessionRequest(session_id=again))
    assert_healthy(limited)


def refused_everywhere(limited: LiveServer, stub: Any) -> None:
    """With the store full, a new session is refused by Salience, Evergreen and the OpenAI API."""
    with pytest.raises(grpc.RpcError) as info:
        stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID))
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "too many open sessions" in info.value.details()

    code, reason, _ = asyncio.run(ws_outcome(limited, text_generate([], [])))
    assert code == 4429 and "too many open sessions" in reason, (code, reason)

    r = httpx.post(limited.http_url + "/v1/sessions", json={"model": TINY_MODEL_ID}, timeout=10)
    assert r.status_code == 429 and "too many open sessions" in r.json()["error"]["message"]


# -- Evergreen node trees and refs -------------------------------------------------------------------


def test_too_deep_node_tree_aborts(limited: LiveServer) -> None:
    chain = [{"id": f"n{i}", "childIds": [f"n{i + 1}"]} for i in range(MAX_DEPTH)]
    leaf = {"id": f"n{MAX_DEPTH}", "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "data": "SGk="}}
    code, reason, _ = asyncio.run(ws_outcome(limited, text_generate([*chain, leaf], ["n0"])))
    assert code == 4400 and "depth" in reason, (code, reason)

    # at the limit it is fine: p -> m1 -> m2 -> leaf is depth 4
    ok = [{"id": "m1", "childIds": ["m2"]}, {"id": "m2", "childIds": ["leaf"]}]
    ok_leaf = {"id": "leaf", "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "data": "SGk="}}
    code, reason, _ = asyncio.run(ws_outcome(limited, text_generate([*ok, ok_leaf], ["m1"])))
    assert code == 1000, (code, reason)


@pytest.mark.parametrize(
    "ref",
    [
        "file:///etc/passwd",
        "file://{root}/../secret.txt",
        "file://{root}/link.txt",  # a symlink out of the root
        "file://otherhost/etc/passwd",
    ],
)
def test_file_refs_outside_the_root_are_refused(limited: LiveServer, file_root: Path, ref: str) -> None:
    message = text_generate([ref_leaf("q", ref.format(root=file_root))], ["q"])
    code, reason, frames = asyncio.run(ws_outcome(limited, message))
    # the reason is cut to the WebSocket limit (123 bytes): long paths hide the end of the message
    assert (code, reason.split(":")[0]) in ((4400, "FAILED_PRECONDITION"), (4400, "INVALID_ARGUMENT")), (code, reason)
    assert "file: ref" in reason, reason
    assert not any("outside the root" in str(f) for f in frames), "the file's content leaked"


def test_file_ref_inside_the_root_is_read(limited: LiveServer, file_root: Path) -> None:
    code, reason, _ = asyncio.run(
        ws_outcome(limited, text_generate([ref_leaf("q", f"file://{file_root}/hello.txt")], ["q"]))
    )
    assert code == 1000, (code, reason)
    assert_healthy(limited)
