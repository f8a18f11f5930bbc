"""The bearer key on every HTTP route and the ``/evergreen`` WebSocket, checked once.

Routes never see an unauthenticated request: :class:`BearerAuth` refuses it first, in
the wire's own form (:mod:`prismgate.edge.refusals`), and runs the route as the key's
principal (:func:`prismgate.core.principal.acting_as`), with the key's name in every
log line. Health, readiness, metrics, the playground's static files and the GraphPipe
control probes stay open: probes and browsers need them before they hold a token. gRPC
services check the same keys in their guard (:mod:`prismgate.codecs.grpc_guard`).

A client presents the token as ``Authorization: Bearer <token>``. Browsers cannot set
headers on a WebSocket, so they may offer it as the subprotocol ``bearer.<token>``
(it then never appears in a URL, so never in a log); the ``access_token`` query
parameter still works for older clients, on a WebSocket handshake only: an HTTP client
can send a header, and a token in a URL ends up in proxies' logs and browser history.
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prismgate.core.errors import GatewayError
from prismgate.core.principal import acting_as
from prismgate.edge.refusals import refuse
from prismgate.keys import KeyRing
from prismgate.logs import log_context
from prismgate.settings.groups import GraphPipe

TOKEN_SUBPROTOCOL = "bearer."


def open_paths(graphpipe: GraphPipe) -> frozenset[str]:
    """Paths served without a token: probes, metrics, the playground's static files, GraphPipe's probes."""
    from prismgate.playground import FILES  # the page's stylesheet and modules

    paths = {"/healthz", "/readyz", "/metrics", "/playground", "/playground/"}
    paths |= {f"/playground/{name}" for name in FILES}
    prefix = graphpipe.path.rstrip("/")
    bases = {prefix} | ({""} if graphpipe.root or not prefix else set())
    for base in bases:
        paths |= {f"{base}/control/is_ready", f"{base}/control/is_alive"}
    return frozenset(paths)


def presented_token(scope: Scope) -> str | None:
    """The ``Authorization`` value the client sent, or one built from a WebSocket's subprotocol or query carrier."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    for offered in scope.get("subprotocols", ()):
        if offered.startswith(TOKEN_SUBPROTOCOL):
            return "Bearer " + offered[len(TOKEN_SUBPROTOCOL) :]
    if scope["type"] != "websocket":
        return None
    for key, value in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
        if key == "access_token":
            return "Bearer " + value
    return None


class BearerAuth:
    """Refuse HTTP requests and WebSockets without a known key, before any route runs; run the rest as its key."""

    def __init__(self, app: ASGIApp, keys: KeyRing, open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in {"http", "websocket"}:
            await self.app(scope, receive, send)
            return
        if not self.keys.enabled or scope["path"] in self.open:
            await self._next(scope, receive, send)
            return
        try:
            principal = self.keys.authenticate(presented_token(scope))
        except GatewayError as exc:
            await refuse(scope, receive, send, exc)
            return
        with acting_as(principal), log_context(key=principal.name):
            await self._next(scope, receive, send)

    async def _next(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            scope, send = _without_token_subprotocol(scope, send)
        await self.app(scope, receive, send)


def _without_token_subprotocol(scope: Scope, send: Send) -> tuple[Scope, Send]:
    """Hide a token subprotocol from the route, and still answer with a subprotocol the client offered.

    A browser fails the handshake when it offered subprotocols and the server picks none,
    so a route that accepts without choosing answers with the client's first other
    subprotocol, or with the token entry when it offered nothing else.
    """
    offered: list[str] = list(scope.get("subprotocols", ()))
    tokens = [p for p in offered if p.startswith(TOKEN_SUBPROTOCOL)]
    if not tokens:
        return scope, send
    others = [p for p in offered if not p.startswith(TOKEN_SUBPROTOCOL)]
    answer = others[0] if others else tokens[0]

    async def send_with_subprotocol(message: Message) -> None:
        if message["type"] == "websocket.accept" and not message.get("subprotocol"):
            message = {**message, "subprotocol": answer}
        await send(message)

    return {**scope, "subprotocols": others}, send_with_subprotocol
