"""Idle keep-alive connections stay open as long as configured (load balancers reuse them)."""

from __future__ import annotations

import socket
import time
from typing import Any

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def exchange(sock: socket.socket) -> bytes:
    sock.sendall(REQUEST)
    sock.settimeout(5)
    data = b""
    while b"\r\n\r\nok" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    return data


def idle_then_reuse(port: int, idle_s: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert exchange(sock).startswith(b"HTTP/1.1 200")
        time.sleep(idle_s)
        try:
            return exchange(sock)
        except (ConnectionResetError, BrokenPipeError):
            return b""


def test_the_default_keeps_idle_connections_longer_than_uvicorns_5_s(live_server: Any) -> None:
    assert live_server.gateway.settings.http.keep_alive_s >= 60
    assert idle_then_reuse(live_server.gateway.http_port, 2.0).startswith(b"HTTP/1.1 200")


def test_a_short_keep_alive_closes_idle_connections(server_factory: Any) -> None:
    with server_factory(http_keep_alive_s=1.0) as server:
        assert idle_then_reuse(server.gateway.http_port, 2.5) == b""
