"""Faults: clients that vanish mid-stream, clients that stop reading, engines that fail mid-generation.

After each fault nothing may leak: the engine has no request left (``in_flight() == 0``), no
admission slot is held, no session is left busy, per-connection sessions are gone, and the
server serves the next request. The model is the EOS-free 4k-context tiny Llama, so a long
generation runs for seconds and a fault lands in the middle of it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import websockets
from graphpipe import convert

from prismgate.core.events import TokenEvent
from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer, tiny_settings
from tests.reliability.conftest import (
    assert_healthy,
    busy_sessions,
    decoded,
    engine_of,
    run_gateway,
    wait_engine_idle,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG = 3000  # tokens: seconds of decoding, so that every fault lands mid-stream
PROMPT = [72, 101, 108, 108, 111]  # "Hello" in the byte-level tokenizer
STRUCT = "type.googleapis.com/google.protobuf.Struct"


def evergreen_generate(max_tokens: int, *, readouts: bool = False) -> str:
    outputs = [{"name": "response", "id": "r"}, {"name": "usage", "id": "u"}]
    if readouts:
        outputs.append({"name": "readouts", "id": "ro"})
    return json.dumps(
        {
            "actions": [
                {
                    "name": "GENERATE",
                    "inputs": [{"name": "prompt", "id": "p"}],
                    "outputs": outputs,
                    "configs": [{"@type": STRUCT, "value": {"maxTokens": max_tokens, "chatTemplate": False}}],
                }
            ],
            "nodeFragments": [
                {
                    "id": "p",
                    "chunkFragment": {
                        "metadata": {"mimetype": "text/plain"},
                        "data": base64.b64encode(b"Hello").decode(),
                    },
                }
            ],
        }
    )


def assert_no_leak(server: LiveServer, sessions_before: int, started_decoded: int, limit: int = LONG // 2) -> None:
    assert wait_engine_idle(server, 10), f"engine still runs {engine_of(server).in_flight()} requests"
    spent = decoded(server) - started_decoded
    assert spent < limit, f"the engine decoded {spent} tokens for a client that was gone"
    assert not busy_sessions(server)
    assert wait_until(lambda: len(server.service.store) == sessions_before, 5), (
        f"{len(server.service.store) - sessions_before} sessions left behind"
    )


# -- clients that vanish ------------------------------------------------------------------------


def test_salience_client_vanishes_mid_stream(long_server: LiveServer) -> None:
    before = len(long_server.service.store)
    channel = grpc.insecure_channel(long_server.grpc_target)
    stub = salience_pb2_grpc.SalienceStub(channel)
    sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
    start = decoded(long_server)
    call = stub.Generate(spb.GenerateRequest(session_id=sid, offset=0, append_tokens=PROMPT, max_tokens=LONG, top_k=1))
    for _ in range(5):
        assert next(call).WhichOneof("event") == "token"
    channel.close()  # the whole connection goes away, mid-stream
    assert_no_leak(long_server, before + 1, start)
    with grpc.insecure_channel(long_server.grpc_target) as again:
        stub = salience_pb2_grpc.SalienceStub(again)
        # the session is free again and kept the append, not the decoded tokens
        assert list(stub.DumpSession(spb.DumpSessionRequest(session_id=sid)).tokens) == PROMPT
        events = list(stub.Generate(spb.GenerateRequest(session_id=sid, offset=len(PROMPT), max_tokens=2, top_k=1)))
        assert events[-1].done.completion_tokens == 2
        stub.CloseSession(spb.CloseSessionRequest(session_id=sid))


async def test_evergreen_client_vanishes_mid_stream(long_server: LiveServer) -> None:
    before = len(long_server.service.store)
    start = decoded(long_server)
    ws = await websockets.connect(long_server.ws_url + "/evergreen", max_size=None)
    await ws.send(evergreen_generate(LONG))
    for _ in range(3):
        await ws.recv()
    ws.transport.abort()  # no close frame: the TCP connection just drops
    await asyncio.to_thread(assert_no_leak, long_server, before, start)


def test_graphpipe_client_vanishes_mid_request(long_server: LiveServer) -> None:
    before = len(long_server.service.store)
    start = decoded(long_server)
    body = bytes(
        convert.serialize_infer_request(
            convert.InferReq(
                json.dumps({"max_tokens": LONG}), [np.array([PROMPT], dtype=np.int64)], ["tokens"], ["tokens"]
            )
        )
    )
    port = long_server.gateway.http_port
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = f"POST /graphpipe HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        sock.sendall(head + body)
        assert wait_until(lambda: decoded(long_server) - start >= 20, 10), "the generation never started"
    assert_no_leak(long_server, before, start)


def test_openai_client_vanishes_mid_stream(long_server: LiveServer) -> None:
    before = len(long_server.service.store)
    start = decoded(long_server)
    body = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", long_server.http_url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = 0
        while seen < 5:
            seen += next(lines).startswith("data:")
    assert_no_leak(long_server, before, start)


# -- clients that stop reading ------------------------------------------------------------------


def wait_stalled(server: LiveServer, start: int, total: int, quiet_s: float = 1.0, within: float = 20.0) -> int:
    """Until the engine's decoded count stops moving for ``quiet_s``; returns tokens decoded by then."""
    deadline = time.monotonic() + within
    last = decoded(server)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = decoded(server)
        if now == last:
            return now - start
        last = now
    return decoded(server) - start


def test_salience_slow_reader_pauses_the_engine(long_server: LiveServer) -> None:
    """gRPC flow control fills, the codec stops pulling, the engine pauses at 64 unread events."""
    options = [("grpc.http2.lookahead_bytes", 16 * 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(long_server.grpc_target, options=options) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
        start = decoded(long_server)
        n = len(PROMPT)
        call = stub.Generate(
            spb.GenerateRequest(
                session_id=sid,
                offset=0,
                append_tokens=PROMPT,
                max_tokens=LONG,
                top_k=1,
                readout_ranges=[spb.PositionRange(start=n, end=n + LONG)],  # kilobytes per event
            )
        )
        assert next(call).WhichOneof("event") == "token"
        stalled = wait_stalled(long_server, start, LONG)
        assert stalled < LONG // 4, f"the engine ran {stalled} tokens ahead of a client that stopped reading"
        assert engine_of(long_server).in_flight() == 1, "paused, not dropped"
        events = list(call)  # read again: the generation resumes and completes
        assert sum(e.WhichOneof("event") == "token" for e in events) == LONG - 1
        assert events[-1].done.completion_tokens == LONG
        stub.CloseSession(spb.CloseSessionRequest(session_id=sid))
    assert wait_engine_idle(long_server)


def small_buffer_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small TCP window
    sock.connect(("127.0.0.1", port))
    return sock


async def test_evergreen_slow_reader_pauses_the_engine(long_server: LiveServer) -> None:
    start = decoded(long_server)
    sock = small_buffer_socket(long_server.gateway.http_port)
    async with websockets.connect(long_server.ws_url + "/evergreen", sock=sock, max_size=None, max_queue=1) as ws:
        await ws.send(evergreen_generate(LONG, readouts=True))
        await ws.recv()
        stalled = await asyncio.to_thread(wait_stalled, long_server, start, LONG)
        try:
            # what runs ahead is what fits in the socket buffers (permessage-deflate makes each
            # token's frames small) plus the session's 64-message outbox: bounded, not the generation
            assert stalled < LONG // 2, f"the engine ran {stalled} tokens ahead of a client that stopped reading"
        finally:
            ws.transport.abort()
    await asyncio.to_thread(wait_engine_idle, long_server)


def test_openai_slow_reader_pauses_the_engine(long_server: LiveServer) -> None:
    start = decoded(long_server)
    body = json.dumps(
        {
            "model": TINY_MODEL_ID,
            "prompt": PROMPT,
            "max_tokens": LONG,
            "temperature": 0,
            "stream": True,
            "readouts": True,
        }
    ).encode()
    sock = small_buffer_socket(long_server.gateway.http_port)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        stalled = wait_stalled(long_server, start, LONG)
        # No flow control in HTTP/1.1: what the kernel's socket buffers hold (a few MB on loopback, hundreds of
        # these kilobyte events) goes out before the server's writes block; then the engine pauses.
        assert stalled < LONG // 2, f"the engine ran {stalled} tokens ahead of a client that stopped reading"
        assert engine_of(long_server).in_flight() == 1
    finally:
        sock.close()
    assert wait_engine_idle(long_server)


# -- engines that fail mid-generation -----------------------------------------------------------

FAIL_AT = 77  # a generation with this max_tokens fails after FAIL_AFTER decoded tokens
FAIL_AFTER = 5


class FailingEngine:
    """Wraps a real engine; a request with ``max_tokens == FAIL_AT`` raises mid-stream."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.model_id = inner.model_id
        self.failures = 0

    @property
    def info(self) -> Any:
        return self.inner.info

    @property
    def stats(self) -> Any:
        return self.inner.stats

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def health(self) -> Any:
        return self.inner.health()

    def image_tokens(self, data: bytes, mime: str) -> int:
        return int(self.inner.image_tokens(data, mime))

    def release(self, session_key: str) -> None:
        self.inner.release(session_key)

    def in_flight(self) -> int:
        return int(self.inner.in_flight())

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        stream = self.inner.generate(request)
        seen = 0
        try:
            async for event in stream:
                yield event
                if isinstance(event, TokenEvent) and not event.is_prefill:
                    seen += 1
                    if request.spec.max_tokens == FAIL_AT and seen >= FAIL_AFTER:
                        self.failures += 1
                        raise RuntimeError("injected engine failure")
        finally:
            await stream.aclose()


@pytest.fixture(scope="module")
def failing_server(long_model_dir: Path, big_pack: Path) -> Iterator[LiveServer]:
    from prismgate.compose import build_engine

    settings = tiny_settings(long_model_dir, big_pack)
    with run_gateway(settings, engine=FailingEngine(build_engine(settings))) as server:
        yield server


def test_engine_error_mid_generation_on_every_protocol(failing_server: LiveServer) -> None:
    server = failing_server
    engine = engine_of(server)
    base_sessions = len(server.service.store)

    # Salience: an INTERNAL status naming the failure; the session is free and kept only its append
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
        call = stub.Generate(
            spb.GenerateRequest(session_id=sid, offset=0, append_tokens=PROMPT, max_tokens=FAIL_AT, top_k=1)
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() is grpc.StatusCode.INTERNAL
        assert "injected engine failure" in info.value.details()
        assert wait_engine_idle(server) and not busy_sessions(server)
        assert list(stub.DumpSession(spb.DumpSessionRequest(session_id=sid)).tokens) == PROMPT
        done = list(stub.Generate(spb.GenerateRequest(session_id=sid, offset=len(PROMPT), max_tokens=3, top_k=1)))
        assert done[-1].done.completion_tokens == 3
        stub.CloseSession(spb.CloseSessionRequest(session_id=sid))

    # Evergreen: the session aborts with 4500 and a reason
    async def evergreen() -> tuple[int, str]:
        async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
            await ws.send(evergreen_generate(FAIL_AT))
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            except websockets.ConnectionClosed as exc:
                assert exc.rcvd is not None
                return exc.rcvd.code, exc.rcvd.reason

    code, reason = asyncio.run(evergreen())
    assert code == 4500 and "INTERNAL" in reason, (code, reason)

    # GraphPipe: an error with a message (status 200 + errors for the Python client's User-Agent)
    body = bytes(
        convert.serialize_infer_request(
            convert.InferReq(
                json.dumps({"max_tokens": FAIL_AT}), [np.array([PROMPT], dtype=np.int64)], ["tokens"], ["tokens"]
            )
        )
    )
    r = httpx.post(server.http_url + "/graphpipe", content=body, timeout=30)
    _, errors = convert.deserialize_infer_response(r.content)
    assert errors and "injected engine failure" in str(errors[0]), errors

    # OpenAI SSE: the stream's last event is an error
    payload = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": FAIL_AT, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.http_url + "/v1/completions", json=payload, timeout=30) as response:
        text = "".join(response.iter_text())
    last = json.loads(text.strip().rsplit("data:", 1)[1])
    assert last["error"]["type"] == "server_error" and last["error"]["message"], last  # the message names no internals

    assert engine.failures == 4
    assert wait_engine_idle(server), f"{engine.in_flight()} engine requests orphaned"
    assert not busy_sessions(server)
    assert wait_until(lambda: len(server.service.store) == base_sessions, 5)
    assert_healthy(server)
