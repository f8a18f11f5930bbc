"""The salience codec (being written)."""

from __future__ import annotations

import grpc

from prismgate.core.service import SessionService
from prismgate.settings import Settings


def add_to_server(server: grpc.aio.Server, service: SessionService, settings: Settings) -> list[str]:
    return []
