"""OpenAI error bodies and HTTP statuses.

The OpenAI API answers every failure with ``{"error": {"message", "type", "param",
"code"}}`` and an HTTP status the official client turns into a typed exception
(400 ``BadRequestError``, 401 ``AuthenticationError``, 404 ``NotFoundError``, 409
``ConflictError``, 429 ``RateLimitError``, 5xx ``InternalServerError``). The client
retries 408/409/429/5xx on its own, so a status is chosen for what a retry would do:
a busy session (409) or a full server (503) may clear up; a bad request never does.
"""

from __future__ import annotations

from typing import Any

from prismgate.core.errors import Code, GatewayError

# gateway code -> (HTTP status, OpenAI error type, default error code)
_BY_CODE: dict[Code, tuple[int, str, str | None]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    Code.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    Code.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    Code.FAILED_PRECONDITION: (409, "invalid_request_error", "conflict"),
    Code.ABORTED: (409, "invalid_request_error", "session_busy"),
    Code.RESOURCE_EXHAUSTED: (429, "insufficient_capacity", "resource_exhausted"),
    Code.UNAVAILABLE: (503, "server_error", "overloaded"),
    Code.CANCELLED: (499, "invalid_request_error", "cancelled"),
    Code.INTERNAL: (500, "server_error", None),
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

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def from_gateway(exc: GatewayError, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    """Translate a core error; ``param``/``code`` refine it when the caller knows the field."""
    status, kind, default_code = _BY_CODE.get(exc.code, (500, "server_error", None))
    return OpenAIError(status, exc.message, type=kind, param=param, code=code or default_code)


def to_openai(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, GatewayError):
        return from_gateway(exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
