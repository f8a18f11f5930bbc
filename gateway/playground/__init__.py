"""The browser playground at ``/playground``: a chat page that talks Evergreen.

Plain HTML, CSS and JavaScript served from this folder by the gateway itself (nothing is
fetched from elsewhere at run time, no build step). The page opens the Evergreen
WebSocket, sends JSON text frames, streams each answer token by token and shades every
token by the readout of a chosen concept at a chosen layer. ``/playground/manifest.json``
tells it the model and the readout manifest (concepts, layers and, when the concept pack has
them, each concept's center per layer: the page shades ``value - center``).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from prismgate.auth import check_bearer
from prismgate.core.errors import GatewayError
from prismgate.core.service import SessionService
from prismgate.settings import Settings

STATIC = Path(__file__).parent
FILES = {"app.js": "text/javascript", "style.css": "text/css"}
NO_CACHE = {"cache-control": "no-cache"}


def manifest(service: SessionService) -> dict[str, object]:
    """What the page needs to know about the model (readouts: null when no concept pack is loaded)."""
    if not service.pool.ready:
        return {"ready": False}
    info = service.info()
    readouts = None
    if info.readouts is not None:
        m = info.readouts
        readouts = {
            "concepts": list(m.concepts),
            "layers": list(m.layers),
            "hiddenSize": m.hidden_size,
            "layerConvention": m.layer_convention,
            "centers": None if m.centers is None else [list(row) for row in m.centers],
        }
    return {
        "ready": True,
        "model": info.model_id,
        "maxModelLen": info.max_model_len,
        "vision": info.vision is not None,
        "readouts": readouts,
        "evergreen": "/evergreen",
    }


def routes(service: SessionService, settings: Settings) -> list[BaseRoute]:
    async def page(_request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=NO_CACHE)

    async def slash(_request: Request) -> Response:
        return RedirectResponse("/playground", status_code=308)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in FILES:
            return JSONResponse({"error": f"no playground file {name!r}"}, status_code=404)
        return FileResponse(STATIC / name, media_type=FILES[name], headers=NO_CACHE)

    async def manifest_json(request: Request) -> Response:
        token = request.query_params.get("access_token")
        authorization = request.headers.get("authorization") or (f"Bearer {token}" if token else None)
        try:
            check_bearer(settings.auth_token, authorization)
        except GatewayError as exc:
            return JSONResponse({"error": exc.message}, status_code=401)
        return JSONResponse(manifest(service), headers=NO_CACHE)

    return [
        Route("/playground", page),
        Route("/playground/", slash),
        Route("/playground/manifest.json", manifest_json),
        Route("/playground/{name}", asset),
    ]
