"""The Evergreen codec: evergreen.v2 sessions over WebSocket (``/evergreen``) and gRPC.

One connection (or one ``StartSession`` stream) is one session: a node store, a core
session whose timeline is the running conversation, and the actions GENERATE, DROP and
CANCEL. The browser playground (``/playground``) rides on it. See docs/evergreen.md.
"""

from __future__ import annotations

import grpc
from starlette.routing import BaseRoute, WebSocketRoute

from prismgate.codecs.evergreen import grpc_service
from prismgate.codecs.evergreen.nodes import Limits
from prismgate.codecs.evergreen.payloads import RefPolicy
from prismgate.codecs.evergreen.session import EvergreenSession, Options
from prismgate.codecs.evergreen.websocket import EvergreenEndpoint
from prismgate.core.service import SessionService
from prismgate.keys import ring_for
from prismgate.settings import Settings

__all__ = ["EvergreenSession", "Options", "add_to_server", "options_from", "routes"]

WEBSOCKET_PATH = "/evergreen"


def options_from(settings: Settings) -> Options:
    return Options(
        limits=Limits(
            max_nodes=settings.evergreen.max_nodes,
            max_bytes=settings.evergreen.max_bytes,
            max_depth=settings.evergreen.max_depth,
        ),
        refs=RefPolicy(
            file_root=settings.evergreen.file_root,
            http=settings.evergreen.http_refs,
            max_bytes=settings.evergreen.ref_max_bytes,
            timeout_s=settings.evergreen.ref_timeout_s,
        ),
        default_max_tokens=settings.evergreen.max_tokens,
        slow_client_timeout_s=settings.streams.timeout_s,
        buffer_bytes=settings.streams.buffer_bytes,
    )


def routes(service: SessionService, settings: Settings) -> list[BaseRoute]:
    """The WebSocket endpoint."""
    return [WebSocketRoute(WEBSOCKET_PATH, EvergreenEndpoint(service, options_from(settings)).handle)]


def add_to_server(server: grpc.aio.Server, service: SessionService, settings: Settings) -> list[str]:
    """Register evergreen.v2.EvergreenService; return its full name."""
    return [grpc_service.add(server, service, options_from(settings), ring_for(settings.security))]
