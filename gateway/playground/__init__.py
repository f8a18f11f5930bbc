"""The browser playground at ``/playground``: a chat page that talks Evergreen.

Plain HTML, CSS and JavaScript served from this folder by the gateway itself (nothing is
fetched from elsewhere at run time, no build step): the script is ES modules (``app.js`` and
what it imports), loaded by the browser as they are. The page opens the Evergreen
WebSocket, sends JSON text frames and streams each answer token by token; prompt tokens come
from ``POST /playground/score`` (:mod:`.scoring`). Every token is shaded by ``value - center``
of a chosen concept at a chosen layer on a fixed scale per concept and layer (:mod:`.calibration`),
and grids show one layer's concepts or one concept's layers for the whole conversation.
``/playground/manifest.json`` tells the page the model, the readout manifest with centers and
scales, the view to open with, and the SAE features (:mod:`.features`); ``/playground/features``
searches the features by label or id.
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
from prismgate.engines.readouts.pack import SteeringRange, view_layer
from prismgate.playground.calibration import scales_for, steering_for
from prismgate.playground.features import features_manifest, search
from prismgate.playground.scoring import BodyTooLarge, parse_messages, read_body, score
from prismgate.settings import Settings

STATIC = Path(__file__).parent
# What /playground/{name} serves: the stylesheet and the page's ES modules (every .js file here,
# app.js the entry), each with its own type: a browser runs a module script only when its
# Content-Type is a JavaScript one, and nosniff holds it to that.
FILES = {"style.css": "text/css", **{path.name: "text/javascript" for path in sorted(STATIC.glob("*.js"))}}
NO_CACHE = {"cache-control": "no-cache"}
ASSET_HEADERS = {**NO_CACHE, "x-content-type-options": "nosniff"}


# Sliders of a pack that measured no steering (built before the builder measured it): the view
# layer, the full reach, every slider at 0, and the page shades by VIEW_CONCEPT until one moves.
UNMEASURED_RANGE = 64
# In a chat it tells the user's question (above its center) from the model's answer (below).
VIEW_CONCEPT = "question"


def view_concept(concepts: tuple[str, ...]) -> int:
    """Index of the concept the page shades by first when nothing is steered: :data:`VIEW_CONCEPT`, else the first."""
    return concepts.index(VIEW_CONCEPT) if VIEW_CONCEPT in concepts else 0


def first_steered(concepts: tuple[str, ...], measured: dict[str, SteeringRange]) -> str | None:
    """The concept the page opens steered: the one whose measured starting scale moved its readout most.

    None when nothing was measured, or nothing moved its readout toward the concept.
    """
    moved = [c for c in measured if measured[c].effect > 0]
    return max(moved, key=lambda c: (measured[c].effect, -concepts.index(c))) if moved else None


def steering_defaults(
    layers: tuple[int, ...], concepts: tuple[str, ...], measured: dict[str, SteeringRange]
) -> dict[str, object]:
    """The steering the page starts with, as the pack measured it (:mod:`~prismgate.instruments.packs.steering_range`).

    ``layer``/``range``: the steering layer and the sliders' reach; ``concept``/``scale``: the
    slider that starts away from 0 (None/0 when nothing was measured); ``concepts``: each measured
    concept's own layer, starting scale, reach and effect (a slider takes its concept's reach, and
    the layer follows the first slider moved from 0).
    """
    first = first_steered(concepts, measured)
    return {
        "layer": layers[view_layer(layers)] if first is None else measured[first].layer,
        "range": max((r.range for r in measured.values()), default=UNMEASURED_RANGE),
        "concept": first,
        "scale": 0 if first is None else measured[first].scale,
        "concepts": {c: measured[c].to_json() for c in concepts if c in measured},
    }


def manifest(service: SessionService, settings: Settings) -> dict[str, object]:
    """What the page needs to know about the model (readouts: null when no concept pack is loaded).

    ``scales`` is ``[layer][concept]`` or null (a pack without them: the page then scales to the
    conversation's largest value and says so); ``defaultLayer`` is an index into ``layers`` and
    ``defaultConcept`` into ``concepts`` (the concept steered first, else :data:`VIEW_CONCEPT`);
    ``steering`` what :func:`steering_defaults` says.
    """
    if not service.pool.ready:
        return {"ready": False}
    info = service.info()
    readouts = None
    if info.readouts is not None:
        m = info.readouts
        measured = steering_for(settings, m, served_default=settings.engine.model is None)
        steering = steering_defaults(m.layers, m.concepts, measured)
        first = first_steered(m.concepts, measured)
        readouts = {
            "concepts": list(m.concepts),
            "layers": list(m.layers),
            "hiddenSize": m.hidden_size,
            "layerConvention": m.layer_convention,
            "centers": None if m.centers is None else [list(row) for row in m.centers],
            "scales": scales_for(settings, m, served_default=settings.engine.model is None),
            "defaultLayer": view_layer(m.layers),
            "defaultConcept": m.concepts.index(first) if first is not None else view_concept(m.concepts),
            "steering": steering,
        }
    return {
        "ready": True,
        "model": info.model_id,
        "maxModelLen": info.max_model_len,
        "vision": info.vision is not None,
        "readouts": readouts,
        "features": features_manifest(info.features),
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
        return FileResponse(STATIC / name, media_type=FILES[name], headers=ASSET_HEADERS)

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

    async def features_json(request: Request) -> Response:
        try:
            authorize(request)
            if not service.pool.ready:
                return JSONResponse({"error": "the model is still loading"}, status_code=503, headers=NO_CACHE)
            found = await asyncio.to_thread(search, service.info().features, dict(request.query_params))
            return JSONResponse(found, headers=NO_CACHE)
        except GatewayError as exc:
            return JSONResponse({"error": exc.message, "code": exc.code.name}, status_code=http_status_of(exc))

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
        Route("/playground/features", features_json),
        Route("/playground/{name}", asset),
    ]
