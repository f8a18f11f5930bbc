"""One error type for the whole gateway.

Every layer raises :class:`GatewayError` with a gRPC-style code; each codec maps the
code onto its own wire (a gRPC status, a GraphPipe ``Error``, an Evergreen abort, an
HTTP status). Keeping one vocabulary means a rule is enforced once, in the core, and
every protocol reports it the same way.
"""

from __future__ import annotations

import enum
import math

QUOTE_CHARS = 200  # of a client's string an error quotes (a model name, a session id, a concept)
MESSAGE_CHARS = 2000  # of any error message: a gRPC status travels in 16 KiB of metadata, with its escapes


class Code(enum.IntEnum):
    """The subset of gRPC status codes the gateway uses, with gRPC's numbers."""

    CANCELLED = 1
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class GatewayError(Exception):
    """A request failed for a reason the client can act on."""

    def __init__(self, code: Code, message: str) -> None:
        if len(message) > MESSAGE_CHARS:  # a quoted client string past quote()'s care must not carry the rest off
            message = message[:MESSAGE_CHARS] + "..."
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        # set once the generation monitor has counted this error (it ended a watched
        # stream), so a codec's refusal counting does not count it twice
        self.reported = False
        # when the client may try again: set on RESOURCE_EXHAUSTED refusals of a key's limits
        # (HTTP ``Retry-After``, gRPC ``retry-after`` trailing metadata)
        self.retry_after_s: float | None = None

    def within(self, where: str) -> GatewayError:
        """This error with ``where`` (an action, a row) in front of its message, still marked if counted."""
        if self.message.startswith(where):
            return self
        out = GatewayError(self.code, f"{where}: {self.message}")
        out.reported = self.reported
        out.retry_after_s = self.retry_after_s
        return out

    def __repr__(self) -> str:
        return f"GatewayError({self.code.name}, {self.message!r})"


def quote(value: str) -> str:
    """A client's string as an error quotes it: ``repr``, cut to :data:`QUOTE_CHARS` characters.

    A 1 MB model name must not become a 1 MB HTTP 404 body or a gRPC trailer past the
    metadata limit (the client would see "Stream removed", not the NOT_FOUND).
    """
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return repr(value[:QUOTE_CHARS]) + f"... ({len(value)} characters)"


def clip(value: str) -> str:
    """:func:`quote` for a wire that puts its own quotes around the string (OpenAI's ``'model'``)."""
    if len(value) <= QUOTE_CHARS:
        return value
    return value[:QUOTE_CHARS] + f"... ({len(value)} characters)"


def invalid(message: str) -> GatewayError:
    return GatewayError(Code.INVALID_ARGUMENT, message)


def not_found(message: str) -> GatewayError:
    return GatewayError(Code.NOT_FOUND, message)


def precondition(message: str) -> GatewayError:
    return GatewayError(Code.FAILED_PRECONDITION, message)


def exhausted(message: str) -> GatewayError:
    return GatewayError(Code.RESOURCE_EXHAUSTED, message)


def denied(message: str) -> GatewayError:
    return GatewayError(Code.PERMISSION_DENIED, message)


def retry_later(message: str, retry_after_s: float) -> GatewayError:
    """RESOURCE_EXHAUSTED with a hint of when a retry may succeed (whole seconds, at least 1)."""
    seconds = max(1, math.ceil(retry_after_s))
    error = exhausted(f"{message}; retry after {seconds} s")
    error.retry_after_s = float(seconds)
    return error
