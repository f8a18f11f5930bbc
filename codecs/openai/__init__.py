"""The OpenAI-compatible HTTP API (``/v1``), so that OpenAI clients work unchanged.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or Server-Sent
Events with ``stream: true``), ``GET /v1/models``; plus two prismgate extensions a
plain OpenAI client never sees unless it asks: per-token concept readouts
(``"readouts"`` in the request) and sessions (``/v1/sessions`` and ``"session_id"``)
that keep a conversation's tokens on the server so each turn sends only its new
messages. docs/openai.md is the reference.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from prismgate.codecs.openai.endpoints import OpenAIEndpoints
from prismgate.core.errors import invalid
from prismgate.core.service import SessionService
from prismgate.settings import Settings

__all__ = ["routes"]


def routes(service: SessionService, settings: Settings) -> list[BaseRoute]:
    if settings.openai.default_max_tokens is not None and settings.openai.default_max_tokens < 1:
        raise invalid(f"openai_default_max_tokens must be >= 1, got {settings.openai.default_max_tokens}")
    api = OpenAIEndpoints(service, settings)
    return [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route("/v1/sessions", api.open_session, methods=["POST"]),
        Route("/v1/sessions", api.list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session_id}", api.get_session, methods=["GET"]),
        Route("/v1/sessions/{session_id}", api.delete_session, methods=["DELETE"]),
        Route("/v1/{rest:path}", api.not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
