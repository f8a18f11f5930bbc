"""Class 5 of issue 13, clients that stop reading, on every protocol with real sockets.

One hostile client per protocol, on a server with as many engine slots, starts a long
generation (with readouts: kilobytes per token) and never reads the answer. Before, such
clients held every slot for as long as they liked. Now:

* a generation whose output fits ``slow_client_buffer_bytes`` ends, and frees its slot,
  while its client still reads nothing (the rest waits in the buffer);
* a generation that does not fit waits for its client only ``slow_client_timeout_s``;
  then the stream is dropped and the generation stopped.

Meanwhile a health probe stays fast, a normal client is served, and memory stays bounded
(:class:`tests.reliability.conftest.UnderAttack`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from graphpipe import convert
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer, tiny_settings
from tests.reliability.conftest import UnderAttack, run_gateway, wait_engine_idle, wait_until

PROMPT = [72, 101, 108, 108, 111]
FITS = 1000  # tokens with readouts: megabytes, more than the socket buffers hold, less than the big buffer
ENDLESS = 3000  # tokens: far more than the small buffer holds
TIMEOUT_S = 2.0
STRUCT = "type.googleapis.com/google.protobuf.Struct"

Hostile = Callable[[LiveServer, int], contextlib.AbstractContextManager[Any]]


@pytest.fixture(scope="module")
def roomy(long_model_dir: Any, big_pack: Any) -> Iterator[LiveServer]:
    """A buffer that holds a whole FITS generation, and a timeout the tests never reach."""
    settings = tiny_settings(
        long_model_dir, big_pack, max_active=4, slow_client_buffer_bytes=64 << 20, slow_client_timeout_s=120.0
    )
    with run_gateway(settings) as server:
        yield server


@pytest.fixture(scope="module")
def tight(long_model_dir: Any, big_pack: Any) -> Iterator[LiveServer]:
    """A small buffer and a short timeout."""
    settings = tiny_settings(
        long_model_dir,
        big_pack,
        max_active=3,
        slow_client_buffer_bytes=64 << 10,
        slow_client_timeout_s=TIMEOUT_S,
        http_send_timeout_s=600.0,  # a dropped client that comes back still reads why (see the test below)
    )
    with run_gateway(settings) as server:
        yield server


@pytest.fixture(scope="module")
def send_timeout(long_model_dir: Any, big_pack: Any) -> Iterator[LiveServer]:
    """Streams never stop for a slow reader (a long slow_client_timeout_s): only the connection's send timeout acts."""
    settings = tiny_settings(
        long_model_dir,
        big_pack,
        max_active=2,
        slow_client_buffer_bytes=64 << 10,
        slow_client_timeout_s=600.0,
        http_send_timeout_s=TIMEOUT_S,
    )
    with run_gateway(settings) as server:
        yield server


def small_socket(server: LiveServer) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small TCP window
    sock.connect(("127.0.0.1", server.gateway.http_port))
    return sock


def read_for(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends within ``seconds`` (or until it closes)."""
    sock.settimeout(0.5)
    out = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


@contextlib.contextmanager
def sse_reader(server: LiveServer, tokens: int) -> Iterator[socket.socket]:
    body = json.dumps(
        {
            "model": TINY_MODEL_ID,
            "prompt": PROMPT,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "readouts": True,
        }
    ).encode()
    with small_socket(server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        yield sock


@contextlib.contextmanager
def websocket_reader(server: LiveServer, tokens: int) -> Iterator[Any]:
    message = {
        "actions": [
            {
                "name": "GENERATE",
                "inputs": [{"name": "prompt", "id": "p"}],
                "outputs": [{"name": "response", "id": "r"}, {"name": "readouts", "id": "ro"}],
                "configs": [{"@type": STRUCT, "value": {"maxTokens": tokens, "temperature": 0, "chatTemplate": False}}],
            }
        ],
        "nodeFragments": [
            {
                "id": "p",
                "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "data": base64.b64encode(b"Hello").decode()},
            }
        ],
    }
    # max_queue=1: the client's reading thread stops taking data from the socket after one frame
    with connect(server.ws_url + "/evergreen", sock=small_socket(server), max_size=None, max_queue=1) as ws:
        ws.send(json.dumps(message))
        yield ws


@contextlib.contextmanager
def grpc_reader(server: LiveServer, tokens: int) -> Iterator[Any]:
    options = [("grpc.http2.lookahead_bytes", 16 * 1024), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.grpc_target, options=options) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID)).session_id
        n = len(PROMPT)
        call = stub.Generate(
            spb.GenerateRequest(
                session_id=sid,
                append_tokens=PROMPT,
                max_tokens=tokens,
                top_k=1,
                readout_ranges=[spb.PositionRange(start=n, end=n + tokens)],
            )
        )
        assert next(call).WhichOneof("event") == "token"
        yield call
        call.cancel()


@contextlib.contextmanager
def graphpipe_reader(server: LiveServer, tokens: int) -> Iterator[socket.socket]:
    request = convert.InferReq(
        json.dumps({"max_tokens": tokens, "temperature": 0}),
        [np.array([PROMPT], dtype=np.int64)],
        ["tokens"],
        ["tokens", "readouts"],
    )
    body = bytes(convert.serialize_infer_request(request))
    with small_socket(server) as sock:
        sock.sendall(f"POST /graphpipe HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        yield sock


PROTOCOLS: dict[str, Hostile] = {
    "openai-sse": sse_reader,
    "evergreen-websocket": websocket_reader,
    "salience-grpc": grpc_reader,
    "graphpipe": graphpipe_reader,
}


def engine_busy(server: LiveServer) -> bool:
    return server.service.pool.admission.active > 0


@pytest.mark.slow
def test_finished_generations_free_their_slots_while_their_clients_read_nothing(roomy: LiveServer) -> None:
    with UnderAttack(roomy.http_url, victim_limit_s=60) as attack, contextlib.ExitStack() as clients:
        for hostile in PROTOCOLS.values():
            clients.enter_context(hostile(roomy, FITS))
        assert wait_until(lambda: engine_busy(roomy), 10), "the generations never started"
        # every client is connected and has read (next to) nothing, yet the engine is free again
        assert wait_engine_idle(roomy, 60), f"{roomy.service.pool.admission.active} slots still held"
        attack.wait_for_victims(1, timeout=10)


@pytest.mark.slow
def test_clients_that_read_nothing_are_dropped_after_the_timeout(tight: LiveServer) -> None:
    streaming = [p for p in PROTOCOLS if p != "graphpipe"]  # GraphPipe answers in one write, after the generation
    decoded_before = int(tight.engine.stats["decoded_tokens"])  # type: ignore[attr-defined]
    with UnderAttack(tight.http_url, victim_limit_s=60) as attack, contextlib.ExitStack() as clients:
        held = {protocol: clients.enter_context(PROTOCOLS[protocol](tight, ENDLESS)) for protocol in streaming}
        assert wait_until(lambda: engine_busy(tight), 10), "the generations never started"
        # what the socket buffers take goes out first (megabytes on loopback), then the writes block
        assert wait_engine_idle(tight, 60), f"{tight.service.pool.admission.active} slots still held"
        attack.wait_for_victims(1, timeout=10)
        spent = int(tight.engine.stats["decoded_tokens"]) - decoded_before  # type: ignore[attr-defined]
        assert spent < len(streaming) * ENDLESS, "the generations ran to their end for clients that read nothing"
        for protocol, client in held.items():
            dropped(protocol, client)


def dropped(protocol: str, client: Any) -> None:
    """What a dropped client reads when it comes back: the rest of what was sent, then the end."""
    if protocol == "openai-sse":
        answer = read_for(client, 15)
        assert b"slow_client_timeout_s" in answer[-2000:], answer[-300:]
    elif protocol == "evergreen-websocket":
        with pytest.raises(ConnectionClosed):  # after the frames sent before the drop
            for _ in range(100_000):
                client.recv(timeout=15)
    else:
        with pytest.raises(grpc.RpcError) as ended:
            for _ in client:
                pass
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "slow_client_timeout_s" in (ended.value.details() or "")


def test_a_connection_whose_client_takes_nothing_is_closed_after_the_send_timeout(send_timeout: LiveServer) -> None:
    """nginx's send_timeout: the socket itself goes, so a client that stopped reading holds no connection."""
    with UnderAttack(send_timeout.http_url, victim_limit_s=60) as attack, sse_reader(send_timeout, ENDLESS) as sock:
        assert wait_until(lambda: engine_busy(send_timeout), 10), "the generation never started"
        # The writes block once the socket buffers are full (megabytes: how long that takes is the
        # machine's speed), then the timer runs out and the connection goes, and its generation with
        # it: long before the 3,000 tokens it asked for.
        closed = wait_until(lambda: not engine_busy(send_timeout), 240)
        assert closed, "the server kept the connection of a client that took nothing"
        # the client comes back: what was buffered, then the end of the connection (not a stream that goes on)
        sock.settimeout(0.5)
        ended, received = False, b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:  # reset: the server aborted the connection
                ended = True
                break
            if not chunk:
                ended = True
                break
            received += chunk
        assert ended, "the connection stayed open after its generation ended"
        assert b"[DONE]" not in received, "the generation ran to its end: the send timeout never acted"
        assert wait_engine_idle(send_timeout, 30), "the generation went on after its connection was closed"
        attack.wait_for_victims(1, timeout=10)
