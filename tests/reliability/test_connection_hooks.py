"""The connection limits hook into uvicorn's httptools protocol: these checks fail if uvicorn stops calling them.

:class:`prismgate.edge.connections.GuardedHTTP` overrides hooks of uvicorn's internal
``HttpToolsProtocol`` (pyproject pins uvicorn to the releases these tests ran on). A renamed
or no longer called hook would switch a limit off silently, so a real uvicorn server on a
free port runs the guarded protocol in front of a small ASGI app, and each check observes
the effect of one group of hooks: the per-address count (``connection_made`` and
``connection_lost``), the head size (``on_url``, ``on_header``, ``on_headers_complete``,
``data_received``), the head deadline (``connection_made``, ``on_message_begin``), the
hand-over of a WebSocket (``handle_websocket_upgrade``) and the send deadline
(``pause_writing``).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from websockets.sync.client import connect

from prismgate.core.errors import Code
from prismgate.edge.connections import ClientConnections, GuardedHTTP, WebSocketCap, guarded_http
from prismgate.settings.groups import HTTP

CAP = 3
HEAD_LIMIT = 2048
HEAD_TIMEOUT_S = 1.0
SEND_TIMEOUT_S = 0.5
WAIT_S = 15.0  # generous upper bound for effects on a busy 2-core machine


@dataclass
class Edge:
    port: int
    clients: ClientConnections
    refusals: list[tuple[str, Code]] = field(default_factory=list)
    stream_ended: threading.Event = field(default_factory=threading.Event)

    def open_count(self) -> int:
        return self.clients._open.get("127.0.0.1", 0)


async def _app(scope: Scope, receive: Receive, send: Send, edge: Edge) -> None:
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        while (await receive())["type"] != "websocket.disconnect":
            pass
        return
    if scope["path"] == "/flood":  # streams until the client is cut off
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"x" * 65536
        try:
            for _ in range(100_000):  # at most 6.5 GB: the send deadline ends it long before
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError:
            pass
        finally:
            edge.stream_ended.set()
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def edge() -> Iterator[Edge]:
    limits = HTTP(
        header_timeout_s=HEAD_TIMEOUT_S,
        send_timeout_s=SEND_TIMEOUT_S,
        max_header_bytes=HEAD_LIMIT,
        max_connections_per_client=CAP,
    )
    clients = ClientConnections(CAP)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    state = Edge(port=sock.getsockname()[1], clients=clients)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await _app(scope, receive, send, state)

    def refused(protocol: str, code: Code) -> None:
        state.refusals.append((protocol, code))

    config = uvicorn.Config(
        WebSocketCap(app, clients),
        http=guarded_http(limits, clients, refused),
        log_config=None,
        lifespan="off",
        access_log=False,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    _wait(lambda: server.started, "the server did not start")
    yield state
    server.should_exit = True
    thread.join(WAIT_S)
    sock.close()


def _wait(condition: Callable[[], bool], message: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.01)


def _raw(edge: Edge) -> socket.socket:
    return socket.create_connection(("127.0.0.1", edge.port), timeout=WAIT_S)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_answer(sock: socket.socket) -> bytes:
    """One ``content-length: 2`` answer on a keep-alive connection."""
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


GET = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def test_every_overridden_hook_exists_in_uvicorns_protocol() -> None:
    overridden = [
        name for name, member in vars(GuardedHTTP).items() if inspect.isfunction(member) and not name.startswith("_")
    ]
    missing = [name for name in overridden if not hasattr(HttpToolsProtocol, name)]
    assert overridden and not missing, f"uvicorn's HttpToolsProtocol has no {missing}: the hooks were renamed"


def test_connections_are_counted_refused_at_the_cap_and_released(edge: Edge) -> None:
    held = [_raw(edge) for _ in range(CAP)]
    try:
        _wait(lambda: edge.open_count() == CAP, f"{edge.open_count()} connections counted, not {CAP}")
        with _raw(edge) as extra:
            answer = _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"max_connections_per_client=3" in answer, answer
        assert ("http", Code.RESOURCE_EXHAUSTED) in edge.refusals
    finally:
        for sock in held:
            sock.close()
    _wait(lambda: edge.open_count() == 0, f"{edge.open_count()} connections still counted after closing")


@pytest.mark.parametrize("in_pieces", [False, True])
def test_a_head_over_the_limit_gets_431(edge: Edge, in_pieces: bool) -> None:
    head = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"x-big: " + b"a" * HEAD_LIMIT + b"\r\n"
    with _raw(edge) as sock:
        if in_pieces:  # never complete: data_received counts what arrives
            sock.sendall(head)
        else:  # complete in one piece: the parser's hooks count it
            sock.sendall(head + b"\r\n")
        assert _read_all(sock).startswith(b"HTTP/1.1 431 ")


def test_the_head_deadline_runs_from_connecting_and_from_a_keep_alive_requests_first_byte(edge: Edge) -> None:
    with _raw(edge) as idle:
        assert _read_all(idle).startswith(b"HTTP/1.1 408 ")
    with _raw(edge) as sock:
        sock.sendall(GET)
        assert _read_answer(sock).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET / HTTP/1.1\r\n")  # a second request that stops inside its head
        assert _read_all(sock).startswith(b"HTTP/1.1 408 ")


def test_a_websocket_is_counted_once_after_the_upgrade(edge: Edge) -> None:
    with connect(f"ws://127.0.0.1:{edge.port}/ws"):
        # the HTTP protocol released it at the upgrade and WebSocketCap counts it: one, not two
        _wait(lambda: edge.open_count() == 1, f"{edge.open_count()} counted for one WebSocket")
        time.sleep(0.1)
        assert edge.open_count() == 1
    _wait(lambda: edge.open_count() == 0, "the WebSocket is still counted after closing")


def test_a_client_that_takes_nothing_is_cut_off_after_the_send_deadline(edge: Edge) -> None:
    edge.stream_ended.clear()
    with _raw(edge) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /flood HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert edge.stream_ended.wait(WAIT_S), "the stream to a client that reads nothing was never cut off"
