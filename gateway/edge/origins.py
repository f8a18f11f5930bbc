"""Which web pages may talk to the server: ``Origin`` checks, CORS on ``/v1``, and the DNS-rebinding defence.

A browser lets any page it shows send requests to a server on the user's own machine (a POST
with a text body, a WebSocket) without asking it first; without a token such a page could drive
the model. So a request with a disallowed ``Origin`` is refused (403, WebSocket close 4403),
``/v1`` answers CORS preflights from allowed origins, and on a loopback address a ``Host`` that
is a DNS name other than ``localhost`` gets 421. The rules in full: docs/architecture.md,
"Browsers and origins".
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prismgate.core.errors import Code
from prismgate.edge.refusals import Refusal, refuse

CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_MAX_AGE_S = "600"


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(host_header: str) -> str:
    """The host of a ``Host`` header, without the port (``[::1]:8000`` -> ``::1``)."""
    return (urlsplit("//" + host_header).hostname or "").lower()


class Origins:
    """The ``allowed_origins`` policy for one server."""

    def __init__(self, raw: str | None) -> None:
        self.any = raw is not None and raw.strip() == "*"
        self.listed = frozenset(o.strip().rstrip("/").lower() for o in (raw or "").split(",") if o.strip())
        self.default = raw is None

    def allows(self, origin: str, host_header: str | None) -> bool:
        origin = origin.rstrip("/").lower()
        if self.any or origin in self.listed:
            return True
        if not self.default:
            return False
        parts = urlsplit(origin)
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            return False  # "null" (sandboxed pages, files) and other schemes
        same = host_header is not None and parts.netloc == host_header.lower()
        return same or is_loopback(parts.hostname)


class OriginPolicy:
    """The ASGI middleware that applies :class:`Origins` and the loopback ``Host`` check."""

    def __init__(self, app: ASGIApp, allowed_origins: str | None, host: str, open_paths: frozenset[str]) -> None:
        """``host``: the address the server binds; ``open_paths``: paths any page may call."""
        self.app = app
        self.origins = Origins(allowed_origins)
        self.open = open_paths
        self.check_host = is_loopback(host)
        self.bind_host = host.strip("[]").lower()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in {"http", "websocket"}:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.check_host and not self._host_allowed(host):
            message = f"Host {host!r} does not name this server (it listens on loopback: use localhost)"
            await refuse(scope, receive, send, Refusal(Code.INVALID_ARGUMENT, message, 421))
            return
        origin = headers.get("origin")
        if origin is None or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        if not self.origins.allows(origin, host):
            message = f"pages from {origin} may not call this server (allowed_origins)"
            await refuse(scope, receive, send, Refusal(Code.UNAUTHENTICATED, message, 403))
            return
        if scope["type"] == "http" and _is_v1(scope["path"]):
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                await _preflight(origin, headers)(scope, receive, send)
                return
            send = _with_allow_origin(send, origin)
        await self.app(scope, receive, send)

    def _host_allowed(self, host: str | None) -> bool:
        """Only a DNS name can be rebound: IP literals and single-label names pass, dotted names must be local."""
        if host is None:
            return True  # HTTP/1.0 without Host: no browser sends that
        name = _host_name(host)
        if name == self.bind_host or is_loopback(name) or "." not in name:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _is_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def _preflight(origin: str, headers: Headers) -> Response:
    return Response(
        status_code=204,
        headers={
            "access-control-allow-origin": origin,
            "access-control-allow-methods": CORS_METHODS,
            "access-control-allow-headers": headers.get("access-control-request-headers", ""),
            "access-control-max-age": CORS_MAX_AGE_S,
            "vary": "Origin",
        },
    )


def _with_allow_origin(send: Send, origin: str) -> Send:
    async def send_with_cors(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            headers["access-control-allow-origin"] = origin
            headers.add_vary_header("Origin")
        await send(message)

    return send_with_cors
