"""The graphpipe codec (being written)."""

from __future__ import annotations

from starlette.routing import BaseRoute

from prismgate.core.service import SessionService
from prismgate.settings import Settings


def routes(service: SessionService, settings: Settings) -> list[BaseRoute]:
    return []
