"""How an aborted Evergreen session tells the client why (the spec defines no error message).

WebSocket: the server closes the socket with code ``4000 + HTTP status`` of the error's
code (the usual gRPC -> HTTP mapping) and a reason ``"<CODE_NAME>: <message>"``; the
message names the offending node or action. WebSocket close reasons hold at most 123
bytes, so longer reasons are cut at a character boundary and end with "...".
gRPC: the stream ends with the error's own status code and the full message as details.
"""

from __future__ import annotations

from prismgate.core.errors import Code, GatewayError

CLOSE_CODES: dict[Code, int] = {
    Code.INVALID_ARGUMENT: 4400,
    Code.UNAUTHENTICATED: 4401,
    Code.NOT_FOUND: 4404,
    Code.ABORTED: 4409,
    Code.FAILED_PRECONDITION: 4412,
    Code.RESOURCE_EXHAUSTED: 4429,
    Code.CANCELLED: 4499,
    Code.INTERNAL: 4500,
    Code.UNAVAILABLE: 4503,
}
CODE_OF_CLOSE = {v: k for k, v in CLOSE_CODES.items()}
MAX_REASON_BYTES = 123


def close_code(error: GatewayError) -> int:
    return CLOSE_CODES.get(error.code, 4500)


def close_reason(error: GatewayError) -> str:
    text = f"{error.code.name}: {error.message}"
    raw = text.encode()
    if len(raw) <= MAX_REASON_BYTES:
        return text
    cut = raw[: MAX_REASON_BYTES - 3].decode("utf-8", errors="ignore")
    return cut + "..."
