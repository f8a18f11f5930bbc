"""One table from core error codes to every wire's status.

The core speaks gRPC's vocabulary (:class:`~prismgate.core.errors.Code`); keeping every wire's
number for it in one table means a client sees a failure the same way whichever protocol it
speaks: HTTP takes Google's canonical mapping of gRPC codes (as grpc-gateway uses it, with 499
for a client that went away), Evergreen over WebSocket closes with ``4000 + HTTP status``, and
gRPC keeps the code. FAILED_PRECONDITION is 400 everywhere (repeating the request unchanged
will not help), ABORTED 409 (a retry may clear it), RESOURCE_EXHAUSTED 429 (refined to 413 by a
codec that read an oversized body).
"""

from __future__ import annotations

from dataclasses import dataclass

from prismgate.core.errors import Code, GatewayError
from prismgate.core.limits import ContextOverflow


@dataclass(frozen=True, slots=True)
class WireStatus:
    """How one core code appears on each wire."""

    http: int
    grpc_name: str

    @property
    def close_code(self) -> int:
        """The Evergreen WebSocket close code."""
        return 4000 + self.http


WIRE_STATUS: dict[Code, WireStatus] = {
    Code.CANCELLED: WireStatus(499, "CANCELLED"),
    Code.INVALID_ARGUMENT: WireStatus(400, "INVALID_ARGUMENT"),
    Code.NOT_FOUND: WireStatus(404, "NOT_FOUND"),
    Code.PERMISSION_DENIED: WireStatus(403, "PERMISSION_DENIED"),
    Code.RESOURCE_EXHAUSTED: WireStatus(429, "RESOURCE_EXHAUSTED"),
    Code.FAILED_PRECONDITION: WireStatus(400, "FAILED_PRECONDITION"),
    Code.ABORTED: WireStatus(409, "ABORTED"),
    Code.INTERNAL: WireStatus(500, "INTERNAL"),
    Code.UNAVAILABLE: WireStatus(503, "UNAVAILABLE"),
    Code.UNAUTHENTICATED: WireStatus(401, "UNAUTHENTICATED"),
}

_INTERNAL = WIRE_STATUS[Code.INTERNAL]


def wire_status(code: Code) -> WireStatus:
    return WIRE_STATUS.get(code, _INTERNAL)


def http_status(code: Code) -> int:
    return wire_status(code).http


def http_status_of(exc: GatewayError) -> int:
    """The HTTP status of a core error, with the one refinement every HTTP route shares.

    A prompt too large for the model's context (:class:`ContextOverflow`, RESOURCE_EXHAUSTED
    in the core) is 400 on HTTP, as OpenAI answers it: the request must change, and a 429
    tells clients to retry the same request later.
    """
    return 400 if isinstance(exc, ContextOverflow) else http_status(exc.code)


def close_code(code: Code) -> int:
    return wire_status(code).close_code


def code_of_close(close: int) -> Code | None:
    """The core code an Evergreen close code stands for (the first, where two share an HTTP status)."""
    for code, status in WIRE_STATUS.items():
        if status.close_code == close:
            return code
    return None
