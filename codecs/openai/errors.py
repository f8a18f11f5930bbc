"""OpenAI error bodies and HTTP statuses.

The OpenAI API answers every failure with ``{"error": {"message", "type", "param",
"code"}}`` and an HTTP status the official client turns into a typed exception
(400 ``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``, 409
``ConflictError``, 429 ``RateLimitError``, 5xx ``InternalServerError``). The client
retries 408/409/429/5xx on its own, so a status is chosen for what a retry would do:
a busy session (409) or a full server (503) may clear up; a bad request never does.
The statuses come from the gateway's one table (:mod:`prismgate.codecs.status`); this
module adds OpenAI's error ``type`` and ``code`` strings.
"""

from __future__ import annotations

from typing import Any

from prismgate.codecs.status import http_status
from prismgate.core.errors import Code, GatewayError, clip
from prismgate.core.limits import ContextOverflow
from prismgate.core.models import UnknownModel

# core code -> (OpenAI error type, default error code); the HTTP status comes from the one table
_TYPES: dict[Code, tuple[str, str | None]] = {
    Code.INVALID_ARGUMENT: ("invalid_request_error", None),
    Code.UNAUTHENTICATED: ("invalid_request_error", "invalid_api_key"),
    Code.NOT_FOUND: ("invalid_request_error", "not_found"),
    Code.PERMISSION_DENIED: ("invalid_request_error", "permission_denied"),
    Code.FAILED_PRECONDITION: ("invalid_request_error", "conflict"),
    Code.ABORTED: ("invalid_request_error", "session_busy"),
    Code.RESOURCE_EXHAUSTED: ("insufficient_capacity", "resource_exhausted"),
    Code.UNAVAILABLE: ("server_error", "overloaded"),
    Code.CANCELLED: ("invalid_request_error", "cancelled"),
    Code.INTERNAL: ("server_error", None),
}


class OpenAIError(Exception):
    """A failure already phrased for the OpenAI wire: status, type, param and code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s: float | None = None  # a key over its limits: sent as Retry-After

    def headers(self) -> dict[str, str] | None:
        """``Retry-After`` (whole seconds) when the refusal says when to retry."""
        return None if self.retry_after_s is None else {"retry-after": str(int(self.retry_after_s))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_gateway(exc: GatewayError, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    """Translate a core error; ``param``/``code`` refine it when the caller knows the field.

    Two core errors have an OpenAI phrasing of their own, the one OpenAI's clients know:
    an unknown model (404 ``model_not_found``) and a prompt that does not fit the context
    (400 ``context_length_exceeded``: OpenAI answers it as a bad request, never as a
    429 its clients would retry).
    """
    if isinstance(exc, UnknownModel):
        served = ", ".join(f"'{name}'" for name in exc.served)
        message = f"The model '{clip(exc.model)}' does not exist; this server serves {served}"
        return OpenAIError(404, message, param="model", code="model_not_found")
    if isinstance(exc, ContextOverflow):
        return OpenAIError(400, _context_message(exc), param=param, code="context_length_exceeded")
    kind, default_code = _TYPES.get(exc.code, ("server_error", None))
    out = OpenAIError(http_status(exc.code), exc.message, type=kind, param=param, code=code or default_code)
    out.retry_after_s = exc.retry_after_s
    return out


def _context_message(exc: ContextOverflow) -> str:
    if exc.prompt_tokens is None:
        return f"This model's maximum context length is {exc.context} tokens. However, {exc.message}."
    wanted = max(exc.max_tokens, 1)
    return (
        f"This model's maximum context length is {exc.context} tokens. However, you requested "
        f"{exc.prompt_tokens + wanted} tokens ({exc.prompt_tokens} in the prompt, {wanted} in the completion). "
        "Please reduce the length of the messages or completion."
    )


def to_openai(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, GatewayError):
        return from_gateway(exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
