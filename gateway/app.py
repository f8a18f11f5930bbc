"""The Starlette application: health, metrics, and every HTTP codec's routes."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from prismgate.core.service import SessionService
from prismgate.metrics import metrics_endpoint
from prismgate.settings import Settings


def create_app(service: SessionService, settings: Settings) -> Starlette:
    async def healthz(_request: Request) -> Response:
        return PlainTextResponse("ok")

    async def readyz(_request: Request) -> Response:
        if not service.pool.ready:
            draining = getattr(service.monitor, "draining", False)
            reason = "shutting down" if draining else "model loading"
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        info = service.info()
        return JSONResponse({"ready": True, "model": info.model_id, "engine": info.engine_name})

    routes: list[BaseRoute] = [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics_endpoint),
    ]
    routes += codec_routes(service, settings)
    app = Starlette(routes=routes)
    app.state.service = service
    app.state.settings = settings
    return app


def codec_routes(service: SessionService, settings: Settings) -> list[BaseRoute]:
    from prismgate.codecs import evergreen, graphpipe, openai

    routes: list[BaseRoute] = []
    for codec in (openai, evergreen, graphpipe):  # graphpipe last: it may own "/"
        routes += codec.routes(service, settings)
    return routes
