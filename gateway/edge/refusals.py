"""One error path for HTTP: every refusal in its wire's form, every refused request counted once.

Which wire a request speaks follows from its path: ``/v1`` is OpenAI (its JSON error
body), ``/evergreen`` is Evergreen (WebSocket close ``4000 + HTTP status``), the
GraphPipe paths answer in GraphPipe's error form (``graphpipe_error_status``), and
anything else is the gateway's own (plain text). Statuses come from the one table,
:mod:`prismgate.codecs.status`.

:class:`RefusalMiddleware` wraps everything the app does: it renders an error no route
handled, and it counts each failed response of a protocol route in
``prismgate_request_errors_total``, unless something inside the request (the
generation observer, an exception handler, the auth middleware) counted it already.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketState

from prismgate.codecs.actionengine import refusal as actionengine_refusal
from prismgate.codecs.evergreen.errors import close_reason
from prismgate.codecs.graphpipe import wire as graphpipe_wire
from prismgate.codecs.graphpipe.http import wants_http_errors
from prismgate.codecs.openai.endpoints import error_response as openai_error_response
from prismgate.codecs.status import WIRE_STATUS, close_code, http_status
from prismgate.core.errors import Code, GatewayError
from prismgate.core.service import SessionService
from prismgate.observer import request_tally
from prismgate.settings.groups import GraphPipe

log = logging.getLogger(__name__)

GATEWAY = "http"
"""The protocol label of the gateway's own routes (health, metrics, playground, unknown paths)."""

CLIENT_CLOSED = 499


class Refusal(GatewayError):
    """A refusal whose HTTP status is more precise than its code's (413, 431, 408...)."""

    def __init__(self, code: Code, message: str, status: int) -> None:
        super().__init__(code, message)
        self.status = status


def status_of(error: GatewayError) -> int:
    return error.status if isinstance(error, Refusal) else http_status(error.code)


def code_of_status(status: int) -> Code:
    """The core code a failed HTTP response stands for (the first in the table with that status)."""
    for code, wire in WIRE_STATUS.items():
        if wire.http == status:
            return code
    if status == 413:
        return Code.RESOURCE_EXHAUSTED
    return Code.INTERNAL if status >= 500 else Code.INVALID_ARGUMENT


class Wires:
    """Which protocol a path belongs to, from the settings that place the routes."""

    def __init__(self, graphpipe: GraphPipe) -> None:
        self.graphpipe_error_status = graphpipe.error_status
        prefix = graphpipe.path.rstrip("/")
        self._graphpipe_prefix = prefix
        self._graphpipe_root = graphpipe.root or not prefix

    def protocol(self, path: str) -> str:
        if path == "/v1" or path.startswith("/v1/"):
            return "openai"
        if path == "/evergreen":
            return "evergreen"
        p = self._graphpipe_prefix
        if p and (path == p or path.startswith(p + "/")):
            return "graphpipe"
        if self._graphpipe_root and (path == "/" or path.startswith("/control/")):
            return "graphpipe"
        return GATEWAY

    def response(self, protocol: str, error: GatewayError, request: Request) -> Response:
        """``error`` as ``protocol``'s clients expect to read it."""
        response = self._response(protocol, error, request)
        if status_of(error) == 408:  # the body was not read to its end: the connection cannot go on
            response.headers["connection"] = "close"
        if error.retry_after_s is not None:  # a key over its limits (every HTTP wire, GraphPipe's 200 form too)
            response.headers["retry-after"] = str(int(error.retry_after_s))
        return response

    def _response(self, protocol: str, error: GatewayError, request: Request) -> Response:
        status = status_of(error)
        if protocol == "openai":
            response = openai_error_response(error)
            response.status_code = status
            return response
        if protocol == "graphpipe":
            if request.method == "GET":
                return JSONResponse({"error": error.message, "code": int(error.code)}, status_code=status)
            if not wants_http_errors(self.graphpipe_error_status, request):
                body = graphpipe_wire.encode_errors([(int(error.code), error.message)])
                return Response(body, media_type="application/octet-stream")
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return PlainTextResponse(error.message + "\n", status_code=status, headers=headers)


async def refuse(scope: Scope, receive: Receive, send: Send, error: GatewayError) -> None:
    """Answer ``error`` in the wire's form and count it, before (instead of) the route."""
    app_state: Any = scope["app"].state
    wires: Wires = app_state.wires
    protocol = wires.protocol(scope["path"])
    service: SessionService = app_state.service
    service.monitor.refused(protocol, error.code)
    if scope["type"] == "websocket":
        await _close_websocket(WebSocket(scope, receive, send), error)
        return
    await wires.response(protocol, error, Request(scope, receive))(scope, receive, send)


async def _close_websocket(websocket: WebSocket, error: GatewayError) -> None:
    """Evergreen's way: accept, then close with ``4000 + status`` and ``"<CODE>: <message>"``.

    (Closing before accepting would reach a browser as a bare HTTP 403, without a reason.)
    An ActionEngine client, which ignores close codes, reads the refusal from its first
    actions' status nodes (:mod:`prismgate.codecs.actionengine.refusal`).
    """
    if websocket.client_state is WebSocketState.CONNECTING:
        await websocket.accept()
        # refused before the route ran, the client's first frame unread; a page (it sends an Origin)
        # is never an ActionEngine client, and its refusal is not held back waiting for a frame
        if websocket.url.path == "/evergreen" and "origin" not in websocket.headers:
            await actionengine_refusal.report(websocket, error)
    code = 4000 + error.status if isinstance(error, Refusal) else close_code(error.code)
    await websocket.close(code, close_reason(error))


async def on_gateway_error(connection: HTTPConnection, exc: Exception) -> Response | None:
    """Starlette exception handler: a GatewayError a route raised, in its wire's form, counted."""
    assert isinstance(exc, GatewayError)
    wires: Wires = connection.app.state.wires
    protocol = wires.protocol(connection.url.path)
    connection.app.state.service.monitor.refused(protocol, exc.code)
    if isinstance(connection, WebSocket):
        await _close_websocket(connection, exc)
        return None
    assert isinstance(connection, Request)
    return wires.response(protocol, exc, connection)


async def on_client_disconnect(_request: Request, _exc: Exception) -> Response:
    """The client left while its body was read: nobody reads the answer, nothing to count."""
    return Response(status_code=CLIENT_CLOSED)


class RefusalMiddleware:
    """Count every failed response of a protocol once; answer any error no route handled."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in {"http", "websocket"}:
            await self.app(scope, receive, send)
            return
        wires: Wires = scope["app"].state.wires
        protocol = wires.protocol(scope["path"])
        started = False

        async def send_counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                if status >= 400 and status != CLIENT_CLOSED and protocol != GATEWAY and not tally.counted:
                    scope["app"].state.service.monitor.refused(protocol, code_of_status(status))
            elif message["type"] == "websocket.accept":
                started = True
            await send(message)

        with request_tally() as tally:
            try:
                await self.app(scope, receive, send_counted)
            except ClientDisconnect:
                return
            except Exception as exc:
                log.exception("unhandled error on %s %s", scope.get("method", "WEBSOCKET"), scope["path"])
                if started:
                    raise
                error = GatewayError(Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
                await refuse(scope, receive, send, error)
