"""The browser playground at ``/playground``: a chat page that talks Evergreen.

Plain HTML, CSS and JavaScript served from this folder by the gateway itself (nothing is
fetched from elsewhere at run time, no build step). The page opens the Evergreen
WebSocket, sends JSON text frames and streams each answer token by token; prompt tokens come
from ``POST /playground/score`` (:mod:`.scoring`). Every token is shaded by ``value - center``
of a chosen concept at a chosen layer on a fixed scale per concept and layer (:mod:`.calibration`),
and grids show one layer's concepts or one concept's layers for the whole conversation.
``/playground/manifest.json`` tells the page the model, the readout manifest with centers and
scales, and the view to open with.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from prismgate.codecs.status import http_status, http_status_of
from prismgate.core.errors import GatewayError, denied
from prismgate.core.principal import current
from prismgate.core.service import SessionService
from prismgate.engines.readouts.pack import view_layer
from prismgate.playground.calibration import scales_for
from prismgate.playground.scoring import BodyTooLarge, parse_messages, read_body, score
from prismgate.settings import Settings

STATIC = Path(__file__).parent
FILES = {"app.js": "text/javascript", "style.css": "text/css"}
NO_CACHE = {"cache-control": "no-cache"}


# The sliders' starting layer and reach for the embedded SmolLM2-135M-Instruct pack, measured with
# greedy answers through the OpenAI API (docs/evergreen.md#playground has the answers): at layer 4,
# +16 turns "What is the capital of France?" French and a rainy Monday sunny, fluently; at every
# layer tried (4, 8, 12, 16) the text degenerates past about 24 ("La la la..."), and at 12 and 16
# +16 still changes nothing. Any other pack: its view layer and the full range (nothing measured).
EMBEDDED_STEERING = {"layer": 4, "range": 32}
UNMEASURED_RANGE = 64


# The concept the page shades by until a slider picks one: in a chat it tells the user's question
# (above its center) from the model's answer (below), so the first screen has both colours; `code`,
# the first by name, is below its center almost everywhere in prose.
VIEW_CONCEPT = "question"


def view_concept(concepts: tuple[str, ...]) -> int:
    """Index of the concept the page shades by first: :data:`VIEW_CONCEPT`, else the first."""
    return concepts.index(VIEW_CONCEPT) if VIEW_CONCEPT in concepts else 0


def steering_defaults(layers: tuple[int, ...], *, served_default: bool) -> dict[str, int]:
    """The steering layer the page starts at and the sliders' reach (+-range)."""
    if served_default and EMBEDDED_STEERING["layer"] in layers:
        return dict(EMBEDDED_STEERING)
    return {"layer": layers[view_layer(layers)], "range": UNMEASURED_RANGE}


def manifest(service: SessionService, settings: Settings) -> dict[str, object]:
    """What the page needs to know about the model (readouts: null when no concept pack is loaded).

    ``scales`` is ``[layer][concept]`` or null (a pack without them: the page then scales to the
    conversation's largest value and says so); ``defaultLayer`` is an index into ``layers`` and
    ``defaultConcept`` into ``concepts``;
    ``steering`` the steering layer (a layer number) and the sliders' reach the page starts with.
    """
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
            "scales": scales_for(settings, m, served_default=settings.model is None),
            "defaultLayer": view_layer(m.layers),
            "defaultConcept": view_concept(m.concepts),
            "steering": steering_defaults(m.layers, served_default=settings.model is None),
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

    def authorize(_request: Request) -> None:
        """The edge has authenticated the key (:mod:`prismgate.edge.auth`); and it must be allowed the playground."""
        principal = current()
        if not principal.playground:
            raise denied(f"key {principal.name!r} may not use the playground")

    async def manifest_json(request: Request) -> Response:
        try:
            authorize(request)
        except GatewayError as exc:
            return JSONResponse({"error": exc.message}, status_code=http_status(exc.code))
        return JSONResponse(manifest(service, settings), headers=NO_CACHE)

    async def score_json(request: Request) -> Response:
        try:
            authorize(request)
            messages = await asyncio.to_thread(parse_messages, await read_body(request))
            body = await score(service, messages)
            return Response(body, media_type="application/json", headers=NO_CACHE)
        except GatewayError as exc:
            status = 413 if isinstance(exc, BodyTooLarge) else http_status_of(exc)
            return JSONResponse({"error": exc.message, "code": exc.code.name}, status_code=status)

    return [
        Route("/playground", page),
        Route("/playground/", slash),
        Route("/playground/manifest.json", manifest_json),
        Route("/playground/score", score_json, methods=["POST"]),
        Route("/playground/{name}", asset),
    ]
