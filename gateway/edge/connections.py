"""Connection limits below ASGI: how long a request head may take, how big it may be, how many per client.

A request that never finishes its headers never reaches an ASGI app, so these limits live in
uvicorn's HTTP protocol (a subclass of its httptools protocol, handed to
``uvicorn.Config(http=...)``), with nginx's defaults in mind. What each limit does, the lingering
close of a refused connection, and how the uvicorn hooks are kept honest: docs/architecture.md,
"Connection limits below ASGI".
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from prismgate.core.errors import Code
from prismgate.edge.refusals import Refusal, refuse
from prismgate.settings.groups import HTTP

log = logging.getLogger(__name__)

Refused = Callable[[str, Code], None]
LINGER_S = 2.0


class ClientConnections:
    """Open connections per client address, shared by the HTTP protocol and the WebSocket middleware."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()

    def acquire(self, address: str) -> bool:
        """Count one more connection from ``address``; False (and nothing counted) when it is at the limit."""
        if self.limit and self._open[address] >= self.limit:
            return False
        self._open[address] += 1
        return True

    def release(self, address: str) -> None:
        self._open[address] -= 1
        if self._open[address] <= 0:
            del self._open[address]


class WebSocketCap:
    """Count each open WebSocket against its client's connections (the HTTP protocol counted it until the upgrade)."""

    def __init__(self, app: ASGIApp, clients: ClientConnections) -> None:
        self.app = app
        self.clients = clients

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if scope["type"] != "websocket" or not client:
            await self.app(scope, receive, send)
            return
        address = client[0]
        if not self.clients.acquire(address):
            limit = self.clients.limit
            message = f"too many connections from {address} (max_connections_per_client={limit})"
            await refuse(scope, receive, send, Refusal(Code.RESOURCE_EXHAUSTED, message, 429))
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.clients.release(address)


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = message.encode() + b"\n"
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class GuardedHTTP(HttpToolsProtocol):
    """uvicorn's httptools protocol with a request-head deadline, a head size limit and a per-client cap."""

    header_timeout_s: float
    send_timeout_s: float
    max_header_bytes: int
    clients: ClientConnections
    refused: Refused

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._head_received = 0  # bytes received while a head was still incomplete
        self._head_size = 0  # the parsed request line and headers
        self._address: str | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        if address is not None:
            if not self.clients.acquire(address):
                limit = self.clients.limit
                message = f"too many connections from {address} (max_connections_per_client={limit})"
                self._refuse(503, "Service Unavailable", message)
                return
            self._address = address
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head()
        self._stop_send()
        self._release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._head_timer is not None and not self._refused:  # the chunk ended inside a head
            self._head_received += len(data)
            if self._head_received > self.max_header_bytes:
                self._refuse_large_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        if self._head_timer is None:
            self._start_head()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_head()
        if self._head_size > self.max_header_bytes:
            self._refuse_large_head()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        # the WebSocket protocol takes over the transport: the WebSocket middleware counts it from here
        self._stop_head()
        self._release()
        super().handle_websocket_upgrade()

    def pause_writing(self) -> None:
        """The client stopped taking what is sent: it has ``send_timeout_s`` to start again."""
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        self._stop_send()
        super().resume_writing()

    def _stop_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        log.info(
            "closed a connection from %s: it took nothing for %gs (http_send_timeout_s)",
            self.client[0] if self.client else "?",
            self.send_timeout_s,
        )
        self.transport.abort()  # nothing can reach a client that reads nothing: no answer, no linger

    def _start_head(self) -> None:
        self._head_received = 0
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _stop_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _release(self) -> None:
        if self._address is not None:
            self.clients.release(self._address)
            self._address = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        message = f"the request headers did not arrive within {self.header_timeout_s:g}s (http_header_timeout_s)"
        self._refuse(408, "Request Timeout", message)

    def _refuse_large_head(self) -> None:
        message = f"the request head is over {self.max_header_bytes} bytes (http_max_header_bytes)"
        self._refuse(431, "Request Header Fields Too Large", message)

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer in plain HTTP and close: no ASGI app has seen this request."""
        self._stop_head()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self.refused("http", Code.RESOURCE_EXHAUSTED)
        self.transport.write(_raw_response(status, reason, message))
        # a lingering close, as nginx does: closing with the client's data unread would reset the
        # connection and could destroy the answer before the client reads it; so send FIN, drop
        # what still comes, and close when the client does (or after LINGER_S)
        try:
            self.transport.write_eof()
        except (OSError, NotImplementedError):  # the client is gone already (or the transport cannot half-close)
            self.transport.close()
        else:
            self.loop.call_later(LINGER_S, self.transport.close)


def guarded_http(http: HTTP, clients: ClientConnections, refused: Refused) -> type[GuardedHTTP]:
    """The protocol class for one gateway, its limits bound (uvicorn instantiates it per connection)."""
    return type(
        "GuardedHTTP",
        (GuardedHTTP,),
        {
            "header_timeout_s": http.header_timeout_s,
            "send_timeout_s": http.send_timeout_s,
            "max_header_bytes": http.max_header_bytes,
            "clients": clients,
            "refused": staticmethod(refused),
        },
    )
