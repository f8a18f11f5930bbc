"""Gateway errors -> gRPC statuses, and the guard every Salience handler runs inside.

Why one wrapper: each RPC must check the bearer token and must turn a
:class:`GatewayError` into its gRPC status with the message as details; doing it per
method would repeat the same try/except six times. The server object is built by
``prismgate.server`` (no interceptors there), so the guard wraps the method handlers
the generated ``add_*Servicer_to_server`` functions register: the same effect as a
server interceptor, limited to the services this codec owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc

from prismgate.auth import check_bearer
from prismgate.core.errors import GatewayError, invalid
from prismgate.logs import log_context

log = logging.getLogger(__name__)

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Streaming = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


def grpc_status(error: GatewayError) -> grpc.StatusCode:
    """The gRPC status for a gateway error code (the core uses gRPC's names and numbers)."""
    return grpc.StatusCode[error.code.name]


T = TypeVar("T")


@contextlib.asynccontextmanager
async def closing(stream: AsyncIterator[T]) -> AsyncGenerator[AsyncIterator[T], None]:
    """Close ``stream`` when the block ends, however it ends.

    A cancelled or failed handler must release the session (its busy flag, the engine
    request) at once, not whenever the garbage collector finalises the generator.
    """
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == name:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


def _log_fields(context: grpc.aio.ServicerContext, method: str) -> dict[str, str]:
    request_id = _metadata(context, "x-request-id") or uuid.uuid4().hex
    return {"protocol": "salience", "rpc": method, "request_id": request_id}


async def _fail(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    """Abort the call with a status a client can act on; never a bare UNKNOWN."""
    if isinstance(exc, GatewayError):
        await context.abort(grpc_status(exc), exc.message)
    log.exception("salience %s failed", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")


class _Malformed:
    """A request whose bytes did not parse: reported as INVALID_ARGUMENT once the caller is authenticated.

    grpc.aio parses requests before any handler runs and answers a parse failure with a
    bare UNKNOWN; parsing leniently moves the failure into the guard, where it gets a
    proper status and message.
    """

    def __init__(self, method: str, error: Exception) -> None:
        self.error = invalid(f"{method}: the request is not a valid protobuf message ({error})")


def _lenient(method: str, deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserializer is None:
            return data
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything else a hostile buffer provokes
            return _Malformed(method, exc)

    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise request.error
    return request


def _guard_unary(method: str, behavior: Unary, token: str | None) -> Unary:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            with log_context(**_log_fields(context, method)):
                check_bearer(token, _metadata(context, "authorization"))
                return await behavior(_checked(request), context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _fail(context, method, exc)

    return guarded


def _guard_streaming(method: str, behavior: Streaming, token: str | None) -> Streaming:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            with log_context(**_log_fields(context, method)):
                check_bearer(token, _metadata(context, "authorization"))
                async with closing(behavior(_checked(request), context)) as events:
                    async for event in events:
                        yield event
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _fail(context, method, exc)

    return guarded


def guard(handlers: Mapping[str, grpc.RpcMethodHandler], token: str | None) -> dict[str, grpc.RpcMethodHandler]:
    """The same method handlers, each checking the token and mapping errors to statuses."""
    out: dict[str, grpc.RpcMethodHandler] = {}
    for method, handler in handlers.items():
        if handler.unary_unary is not None:
            out[method] = grpc.unary_unary_rpc_method_handler(
                _guard_unary(method, handler.unary_unary, token),
                request_deserializer=_lenient(method, handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        elif handler.unary_stream is not None:
            out[method] = grpc.unary_stream_rpc_method_handler(
                _guard_streaming(method, handler.unary_stream, token),
                request_deserializer=_lenient(method, handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        else:
            raise TypeError(f"{method}: only unary and server-streaming methods are guarded")
    return out


class _Capture:
    """Stands in for the server while a generated ``add_*_to_server`` registers its handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, _handlers: Any) -> None:
        pass  # the same handlers arrive through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        self.service = service
        self.handlers = dict(handlers)


def add_guarded(
    server: grpc.aio.Server,
    add_servicer: Callable[[Any, Any], None],
    servicer: Any,
    token: str | None,
) -> str:
    """Register ``servicer`` through its generated ``add_servicer`` function, guarded; return its service name."""
    capture = _Capture()
    add_servicer(servicer, capture)
    if not capture.handlers:
        raise RuntimeError(f"{add_servicer.__name__} registered no method handlers")
    handlers = guard(capture.handlers, token)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)
    return capture.service
