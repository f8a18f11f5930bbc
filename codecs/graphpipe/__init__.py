"""GraphPipe (flatbuffers over HTTP POST/GET) onto the Session/Action core.

Each row of an InferRequest becomes one ephemeral generation (``SessionService.run``);
the tensor mapping lives in :mod:`.inputs`, :mod:`.config` and :mod:`.outputs`, the
per-row core turns in :mod:`.plan`, running them in :mod:`.infer`, buffer verification in
:mod:`.verify`, flatbuffer encoding and decoding in :mod:`.wire`, the HTTP side in :mod:`.http`.
Reference: ``docs/graphpipe.md``.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import BaseRoute, Route

from prismgate.codecs.graphpipe.http import GraphPipeEndpoint, is_alive, is_ready_endpoint
from prismgate.core.errors import invalid
from prismgate.core.service import SessionService
from prismgate.settings import Settings

__all__ = ["routes"]


def routes(service: SessionService, settings: Settings) -> list[BaseRoute]:
    """The GraphPipe routes: under ``graphpipe_path``, and on ``/`` when ``graphpipe_root``; each
    served model also on ``<graphpipe_path>/<model>``.

    The app mounts these last, so routes other codecs own at the same paths win.
    """
    path = settings.graphpipe.path.rstrip("/")
    if path and not path.startswith("/"):
        raise invalid(f"graphpipe_path must start with '/', got {settings.graphpipe.path!r}")
    if settings.graphpipe.max_body_bytes < 1 or settings.graphpipe.max_batch < 1:
        raise invalid("graphpipe_max_body_bytes and graphpipe_max_batch must be >= 1")
    is_ready = is_ready_endpoint(service)
    prefixes = [path] if path else []
    if settings.graphpipe.root or not path:
        prefixes.append("")
    out: list[BaseRoute] = []
    for prefix in prefixes:
        name = "graphpipe" if prefix else "graphpipe_root"
        out += _endpoint_routes(GraphPipeEndpoint(service, settings), prefix, name, is_ready)
    # every served model on <graphpipe_path>/<model>; the bare path serves the default model
    for model in service.models.names:
        endpoint = GraphPipeEndpoint(service, settings, model)
        out += _endpoint_routes(endpoint, f"{path}/{model}", f"graphpipe_model_{model}", is_ready)
    return out


def _endpoint_routes(endpoint: GraphPipeEndpoint, prefix: str, name: str, is_ready: Any) -> list[BaseRoute]:
    out: list[BaseRoute] = [Route(prefix or "/", endpoint.handle, methods=["GET", "POST"], name=name)]
    if prefix:
        out.append(Route(prefix + "/", endpoint.handle, methods=["GET", "POST"], name=name + "_slash"))
    out.append(Route(prefix + "/control/is_ready", is_ready, methods=["GET"], name=name + "_is_ready"))
    out.append(Route(prefix + "/control/is_alive", is_alive, methods=["GET"], name=name + "_is_alive"))
    return out
