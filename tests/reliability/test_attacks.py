"""Every class of issue 13, each by its own hostile client on a real socket, under watch.

Each test runs its attack inside :class:`~tests.reliability.conftest.UnderAttack`: a
``/healthz`` probe stays fast, a normal client keeps being served, RSS stays bounded.
The refusals themselves (messages, codes) are tested in detail where each limit lives
(``tests/*/test_hostile.py``, ``tests/reliability/test_edge.py``); here the point is that
the server as a whole shrugs the attack off. Class 5 (clients that stop reading) is in
``test_slow_readers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import requests
import websockets
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from prismgate.core.budget import RequestBudget
from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.evergreen.test_hostile import doubling_dag
from tests.evergreen.wire import generate, msg, parent, uid
from tests.graphpipe.helpers import infer_buffer, read_response
from tests.reliability.conftest import UnderAttack, wait_until

BUDGET = RequestBudget()
MAX_SESSIONS = 8
MAX_BODY = 32 << 20  # over the 20 MB prompt of test_4_a_prompt_of_megabytes


@pytest.fixture(scope="module")
def file_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("attack-refs")
    (root / "hello.txt").write_text("Hello from a file.")
    return root


@pytest.fixture(scope="module")
def server(server_factory: Any, file_root: Path) -> Iterator[LiveServer]:
    with server_factory(
        max_sessions=MAX_SESSIONS,
        http_header_timeout_s=1.0,
        http_body_timeout_s=1.0,
        evergreen_file_root=str(file_root),
        openai_max_body_bytes=MAX_BODY,
    ) as live:
        yield live


async def closed_with(ws: Any, within: float = 30) -> tuple[int, str]:
    try:
        async with asyncio.timeout(within):
            while True:
                await ws.recv()
    except websockets.ConnectionClosed as exc:
        assert exc.rcvd is not None, "closed without a close frame"
        return exc.rcvd.code, exc.rcvd.reason


async def evergreen_refused(server: LiveServer, frame: str | bytes) -> tuple[int, str]:
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        await ws.send(frame)
        return await closed_with(ws)


# -- 1. amplification, 2. quadratic bookkeeping ---------------------------------------------------


async def test_1_a_dag_that_expands_to_millions_of_leaves(server: LiveServer) -> None:
    levels = 24
    frame = msg(actions=[generate(f"n{levels}", "r")], fragments=doubling_dag(levels))
    with UnderAttack(server.http_url):
        for _ in range(3):
            code, reason = await evergreen_refused(server, frame)
            assert code == 4429 and "leaves" in reason, reason


async def test_2_thousands_of_actions_in_one_frame(server: LiveServer) -> None:
    waiting = generate("never", "r")
    drops = [{"name": "DROP", "inputs": [{"name": "x", "id": "never"}]}] * (BUDGET.max_actions_in_flight + 10)
    with UnderAttack(server.http_url):
        for _ in range(3):
            code, reason = await evergreen_refused(server, msg(actions=[waiting, *drops]))
            assert code == 4429 and "actions are still running" in reason, reason


# -- 3. unbounded lists, 4. work before the cheap check -------------------------------------------


def test_3_a_million_position_ranges(server: LiveServer) -> None:
    with UnderAttack(server.http_url), grpc.insecure_channel(server.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
        million = [spb.PositionRange(start=0, end=1)] * 1_000_000
        request = spb.GenerateRequest(session_id=sid, append_tokens=[1, 2], max_tokens=1, logprobs_ranges=million)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(request, timeout=30))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stub.CloseSession(spb.CloseSessionRequest(session_id=sid))


def test_4_a_prompt_of_megabytes(server: LiveServer) -> None:
    content = "a " * (10 << 20)  # 20 MB of text
    body = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": content}]}
    with UnderAttack(server.http_url, rss_limit_mb=400):
        for _ in range(2):
            reply = httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"


def test_4_bodies_over_the_limit(server: LiveServer) -> None:
    """150 MB announced: refused unread; 40 MB sent chunked (no length): refused once past the limit."""
    port = server.gateway.http_port
    with UnderAttack(server.http_url):
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 150000000\r\n\r\n"
                )
                answer = b""
                while b"openai_max_body_bytes" not in answer and (chunk := sock.recv(65536)):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 413 ") and b"openai_max_body_bytes" in answer, answer[:300]

            def chunks() -> Iterator[bytes]:
                yield b'{"model": "tiny-llama", "prompt": "'
                for _ in range(40):
                    yield b"a" * (1 << 20)

            reply = httpx.post(server.http_url + "/v1/completions", content=chunks(), timeout=30)
            assert reply.status_code == 413, reply.text


# -- 6. connections that never finish, 7. idle sessions ------------------------------------------


def test_6_heads_and_bodies_that_never_finish(server: LiveServer) -> None:
    port = server.gateway.http_port
    with UnderAttack(server.http_url), contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10)) for _ in range(40)]
        for i, sock in enumerate(socks):
            if i % 2:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            else:
                sock.sendall(
                    b'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{"model": '
                )
        for sock in socks:
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]


def test_7_idle_connections_hold_no_sessions(server: LiveServer) -> None:
    store = server.service.store
    with UnderAttack(server.http_url), contextlib.ExitStack() as stack:
        for _ in range(MAX_SESSIONS * 4):
            stack.enter_context(ws_connect(server.ws_url + "/evergreen"))
        time.sleep(0.5)
        assert len(store) < MAX_SESSIONS
        with grpc.insecure_channel(server.grpc_target) as channel:  # other protocols still get sessions
            stub = salience_pb2_grpc.SalienceStub(channel)
            sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID), timeout=10).session_id
            stub.CloseSession(spb.CloseSessionRequest(session_id=sid), timeout=10)


# -- 8. secrets and origins ------------------------------------------------------------------


def test_8_pages_from_other_origins_and_rebound_hosts(server: LiveServer) -> None:
    port = server.gateway.http_port
    with UnderAttack(server.http_url):
        for _ in range(20):
            with ws_connect(server.ws_url + "/evergreen", origin="http://evil.example") as ws:  # type: ignore[arg-type]
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 4403
            rebound = httpx.get(server.http_url + "/v1/models", headers={"Host": f"evil.example:{port}"})
            assert rebound.status_code == 421


# -- 9. bad input is never a 500 ------------------------------------------------------------


DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" * 5000


def test_9_deep_json_and_huge_integers_over_http(server: LiveServer) -> None:
    bodies = [
        DEEP,
        '{"model": "tiny-llama", "prompt": "hi", "max_tokens": ' + HUGE_INT + "}",
        '{"model": "tiny-llama", "prompt": "hi", "stop": ' + "[" * 70 + "]" * 70 + "}",
    ]
    with UnderAttack(server.http_url):
        for body in bodies:
            reply = httpx.post(server.http_url + "/v1/completions", content=body, timeout=30)
            assert reply.status_code == 400, reply.text
            message = reply.json()["error"]["message"]
            assert "max_json_depth" in message or "digits" in message, message
        for config in (DEEP, '{"max_tokens": ' + HUGE_INT + "}"):
            reply = requests.post(server.http_url + "/graphpipe", data=infer_buffer([np.array(["hi"])], config=config))
            _, errors = read_response(reply.content)
            assert reply.status_code == 200 and errors[0]["code"] == 3, errors  # INVALID_ARGUMENT
        overflow = overflowing_shape_request()
        reply = requests.post(
            server.http_url + "/graphpipe", data=overflow, headers={"User-Agent": "Go-http-client/1.1"}
        )
        assert reply.status_code == 400 and "2**60" in reply.text, reply.text


def overflowing_shape_request() -> bytes:
    """An Int64 tensor of shape [0, 2**62, 2**62]: no data, yet numpy cannot shape it."""
    import flatbuffers

    from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp

    b = flatbuffers.Builder(256)
    shape = b.CreateNumpyVector(np.asarray([0, 2**62, 2**62], dtype="<i8"))
    data = b.CreateNumpyVector(np.zeros(0, np.uint8))
    gp.TensorStart(b)
    gp.TensorAddType(b, gp.Type.Int64)
    gp.TensorAddShape(b, shape)
    gp.TensorAddData(b, data)
    tensor = gp.TensorEnd(b)
    b.StartVector(4, 1, 4)
    b.PrependUOffsetTRelative(tensor)
    tensors = b.EndVector()
    gp.InferRequestStart(b)
    gp.InferRequestAddInputTensors(b, tensors)
    infer = gp.InferRequestEnd(b)
    gp.RequestStart(b)
    gp.RequestAddReqType(b, gp.Req.InferRequest)
    gp.RequestAddReq(b, infer)
    b.Finish(gp.RequestEnd(b))
    return bytes(b.Output())


async def test_9_deep_json_and_a_nul_in_a_file_ref_over_evergreen(server: LiveServer) -> None:
    with UnderAttack(server.http_url):
        code, reason = await evergreen_refused(server, '{"actions": ' + DEEP + "}")
        assert code == 4400 and "max_json_depth" in reason, reason
        code, reason = await evergreen_refused(server, '{"actions": [], "x": ' + HUGE_INT + "}")
        assert code == 4400, reason
        prompt = uid()
        ref = {"id": "f", "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "ref": "file:///hello\u0000.txt"}}
        code, reason = await evergreen_refused(
            server, msg(actions=[generate(prompt, "r")], fragments=[parent(prompt, "f"), ref])
        )
        assert code == 4400 and "NUL" in reason, reason


def test_9_garbage_on_the_evergreen_grpc_stream(server: LiveServer) -> None:
    with UnderAttack(server.http_url), grpc.insecure_channel(server.grpc_target) as channel:
        start = channel.stream_stream(
            "/evergreen.v2.EvergreenService/StartSession", request_serializer=lambda b: b, response_deserializer=bytes
        )
        for garbage in (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x00" * 64):
            with pytest.raises(grpc.RpcError) as ended:
                list(start(iter([garbage]), timeout=30))
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ended.value.details()


def test_9_a_cancelled_salience_stream_logs_no_error(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    """Cancelled while the server waits to write (the client stopped reading first): the case that logged."""
    caplog.set_level(logging.DEBUG)
    options = [("grpc.http2.lookahead_bytes", 16 * 1024), ("grpc.http2.bdp_probe", 0)]
    with UnderAttack(server.http_url), grpc.insecure_channel(server.grpc_target, options=options) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        for _ in range(5):
            sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
            request = spb.GenerateRequest(
                session_id=sid,
                append_tokens=[72, 105],
                max_tokens=300,
                top_k=1,
                readout_ranges=[spb.PositionRange(start=2, end=302)],
                logprobs_ranges=[spb.PositionRange(start=2, end=302)],
                logprob_top_k=20,
            )
            call = stub.Generate(request)
            next(call)
            time.sleep(0.5)  # the flow-control window fills: the server is left waiting on a write
            call.cancel()
            assert wait_until(lambda sid=sid: not server.call(server.service.session(sid)).busy, 10)
            stub.CloseSession(spb.CloseSessionRequest(session_id=sid))
        _collect_garbage_on(server)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    text = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert "different Context" not in text and "never retrieved" not in text
    assert not errors, [r.getMessage() for r in errors]


def _collect_garbage_on(server: LiveServer) -> None:
    """Let the loop finalise abandoned generators (where the context error used to surface)."""
    import gc

    done = threading.Event()
    gc.collect()
    server.loop.call_soon_threadsafe(done.set)
    done.wait(5)
    time.sleep(0.2)
