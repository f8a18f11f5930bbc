"""The Starlette application: health, metrics, every HTTP codec's routes, and the edge in front of them.

Every request passes the edge middleware in this order: :class:`~prismgate.edge.refusals.RefusalMiddleware`
(the one error path: refusals in the wire's form, each counted once),
:class:`~prismgate.edge.origins.OriginPolicy` (before auth: browsers send no token on a
preflight), :class:`~prismgate.edge.landing.LandingPage`, :class:`~prismgate.edge.auth.BearerAuth`,
:class:`~prismgate.edge.connections.WebSocketCap` and :class:`~prismgate.edge.timeouts.BodyTimeout`.
A route that raises a :class:`~prismgate.core.errors.GatewayError` is answered by the same error
path. Limits that apply before a request exists (head timeout and size, connections per client)
live in the HTTP protocol, :mod:`prismgate.edge.connections`.
"""

from __future__ import annotations

from typing import cast

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ExceptionHandler

from prismgate.core.errors import GatewayError
from prismgate.core.service import SessionService
from prismgate.drain import Drain
from prismgate.edge.auth import BearerAuth, open_paths
from prismgate.edge.connections import ClientConnections, WebSocketCap
from prismgate.edge.landing import LandingPage
from prismgate.edge.origins import OriginPolicy
from prismgate.edge.refusals import RefusalMiddleware, Wires, on_client_disconnect, on_gateway_error
from prismgate.edge.timeouts import BodyTimeout
from prismgate.keys import ring_for
from prismgate.metrics import GatewayMetrics, metrics_endpoint
from prismgate.settings import Settings


def create_app(
    service: SessionService,
    settings: Settings,
    *,
    metrics: GatewayMetrics | None = None,
    drain: Drain | None = None,
) -> Starlette:
    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(_request: Request) -> Response:
        models = {
            name: {"ready": health.ready, "state": health.state.value, "reason": health.reason}
            for name, health in service.models.health().items()
        }
        if drain is not None and drain.draining:
            return JSONResponse({"ready": False, "reason": "shutting down", "models": models}, status_code=503)
        health = service.pool.health()
        if not health.ready:
            body: dict[str, object] = {
                "ready": False,
                "state": health.state.value,
                "reason": health.reason,
                "models": models,
            }
            return JSONResponse(body, status_code=503)
        store_down = await service.store.unreachable()
        if store_down is not None:  # every session call would fail: a load balancer should send none here
            body = {"ready": False, "state": "store_unavailable", "reason": store_down, "models": models}
            return JSONResponse(body, status_code=503)
        info = service.info()
        answer: dict[str, object] = {"ready": True, "model": info.model_id, "engine": info.engine_name}
        if info.dtype:
            answer["dtype"] = {"name": info.dtype, "reason": info.dtype_reason}
        if info.packed_reason:
            answer["packed_weights"] = {"layers": info.packed_layers, "reason": info.packed_reason}
        if info.huge_pages_reason:
            answer["huge_pages"] = {"bytes": info.huge_page_bytes, "reason": info.huge_pages_reason}
        if info.mixed_passes_reason:
            answer["mixed_passes"] = {"enabled": info.mixed_passes, "reason": info.mixed_passes_reason}
        return JSONResponse({**answer, "models": models})

    async def favicon(_request: Request) -> Response:
        # browsers ask for it on every page (the playground, /metrics): no icon, and no 404 in the console
        return Response(status_code=204, headers={"cache-control": "max-age=86400"})

    routes: list[BaseRoute] = [
        Route("/favicon.ico", favicon),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics_endpoint),
    ]
    routes += codec_routes(service, settings)
    clients = ClientConnections(settings.http.max_connections_per_client)
    unguarded = open_paths(settings.graphpipe)
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(RefusalMiddleware),
            Middleware(
                OriginPolicy,
                allowed_origins=settings.security.allowed_origins,
                host=settings.server.host,
                open_paths=unguarded,
            ),
            Middleware(LandingPage, graphpipe_path=settings.graphpipe.path, playground=settings.server.playground),
            Middleware(BearerAuth, keys=ring_for(settings.security), open_paths=unguarded),
            Middleware(WebSocketCap, clients=clients),
            Middleware(BodyTimeout, timeout_s=settings.http.body_timeout_s),
        ],
        # one handler for HTTP and WebSocket routes (Starlette passes either connection)
        exception_handlers={
            GatewayError: cast(ExceptionHandler, on_gateway_error),
            ClientDisconnect: on_client_disconnect,
        },
    )
    app.state.service = service
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.wires = Wires(settings.graphpipe)
    app.state.clients = clients  # shared with the HTTP protocol (prismgate.server)
    return app


def codec_routes(service: SessionService, settings: Settings) -> list[BaseRoute]:
    from prismgate.codecs import evergreen, graphpipe, openai

    routes: list[BaseRoute] = []
    for codec in (openai, evergreen):
        routes += codec.routes(service, settings)
    if settings.server.playground:  # the browser page that speaks Evergreen over /evergreen
        from prismgate.playground import routes as playground_routes

        routes += playground_routes(service, settings)
    return routes + graphpipe.routes(service, settings)  # graphpipe last: it may own "/"
