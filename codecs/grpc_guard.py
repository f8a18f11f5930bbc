"""The guard every gRPC service of the gateway runs inside (Salience, Evergreen, companions).

Why one wrapper: each RPC must check the bearer key (and run as its principal, with the
key's name in the log lines), log under the caller's request id, turn a request whose
bytes do not parse into INVALID_ARGUMENT (not grpc's bare UNKNOWN), turn a
:class:`GatewayError` into its status (through the one table, :mod:`prismgate.codecs.status`)
with the message as details (and a ``retry-after`` trailer when it says when to retry),
and count every refusal in the errors metric. Doing it per method or per service is how services drifted
apart. The server object is built by ``prismgate.server`` (no interceptors there), so
the guard wraps the method handlers the generated ``add_*Servicer_to_server`` functions
register: the same effect as a server interceptor, limited to the services it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import grpc

from prismgate.codecs.outflow import SlowReader, reader_deadline
from prismgate.codecs.status import wire_status
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.principal import acting_as
from prismgate.core.service import SessionService
from prismgate.keys import KeyRing
from prismgate.logs import log_context

log = logging.getLogger(__name__)

Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
Streaming = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]
Writer = Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]
T = TypeVar("T")


def grpc_status(code: Code) -> grpc.StatusCode:
    """The gRPC status for a core error code."""
    return grpc.StatusCode[wire_status(code).grpc_name]


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


def metadata(context: grpc.aio.ServicerContext, name: str) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == name:
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class _Malformed:
    """A request whose bytes did not parse: reported as INVALID_ARGUMENT once the caller is authenticated.

    grpc.aio parses requests before any handler runs and answers a parse failure with a
    bare UNKNOWN; parsing leniently moves the failure into the guard, where it gets a
    proper status and message.
    """

    def __init__(self, method: str, error: Exception) -> None:
        self.error = invalid(f"{method}: the request is not a valid protobuf message ({error})")


OFF_LOOP_BYTES = 64 * 1024  # larger requests are parsed in a worker thread


class _Unparsed:
    """A large request's bytes: parsed by the handler off the event loop (a million two-byte
    list elements take half a second to become objects)."""

    def __init__(self, data: bytes, parse: Callable[[bytes], Any]) -> None:
        self.data = data
        self.parse = parse


def _lenient(method: str, deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserializer is None:
            return data
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything else a hostile buffer provokes
            return _Malformed(method, exc)

    def parse_small(data: bytes) -> Any:
        return _Unparsed(data, parse) if len(data) > OFF_LOOP_BYTES else parse(data)

    return parse_small


async def _checked(request: Any) -> Any:
    if isinstance(request, _Unparsed):
        request = await asyncio.to_thread(request.parse, request.data)
    if isinstance(request, _Malformed):
        raise request.error
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream whose malformed message raises INVALID_ARGUMENT where the handler reads it."""
    async for request in requests:
        yield await _checked(request)


class Guard:
    """Wraps the handlers of one protocol's services."""

    def __init__(
        self, service: SessionService, protocol: str, keys: KeyRing, *, slow_client_timeout_s: float | None = None
    ) -> None:
        self.service = service
        self.protocol = protocol
        self.keys = keys
        self.slow_client_timeout_s = slow_client_timeout_s

    def _fields(self, context: grpc.aio.ServicerContext, method: str) -> dict[str, str]:
        request_id = metadata(context, "x-request-id") or uuid.uuid4().hex
        return {"protocol": self.protocol, "rpc": method, "request_id": request_id}

    async def _principal(self, context: grpc.aio.ServicerContext, method: str) -> contextlib.ExitStack:
        """The call's key, to run the call as (its name in every log line); an unknown key aborts the call.

        The refusal of anything after this (a permission, a limit) is counted and logged under the key.
        """
        try:
            principal = self.keys.authenticate(metadata(context, "authorization"))
        except GatewayError as exc:
            await self._fail(context, method, exc)  # raises AbortError
            raise
        stack = contextlib.ExitStack()
        stack.enter_context(log_context(key=principal.name))
        stack.enter_context(acting_as(principal))
        return stack

    async def _fail(self, context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
        """Abort the call with a status a client can act on; never a bare UNKNOWN."""
        if isinstance(exc, GatewayError):
            if not exc.reported:  # errors that ended a generation were counted by its monitor
                self.service.monitor.refused(self.protocol, exc.code)
            if exc.retry_after_s is not None:  # a key over its limits: when to try again
                context.set_trailing_metadata((("retry-after", str(int(exc.retry_after_s))),))
            await context.abort(grpc_status(exc.code), exc.message)
        log.exception("%s %s failed", self.protocol, method)
        self.service.monitor.refused(self.protocol, Code.INTERNAL)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")

    def unary(self, method: str, behavior: Unary) -> Unary:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with log_context(**self._fields(context, method)), await self._principal(context, method):
                try:
                    return await behavior(await _checked(request), context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await self._fail(context, method, exc)

        return guarded

    def streaming(self, method: str, behavior: Streaming, *, client_streams: bool) -> Writer:
        """A streaming handler that writes each message itself (``context.write``), in one task.

        Why not an async generator: grpc.aio may leave a generator suspended at a ``yield``
        when the client cancels and close it later from another task (a context variable set
        before the ``yield`` is then reset in another Context: "was created in a different
        Context", "Task exception was never retrieved"), and it logs a write the client
        cancelled as an error. Writing here keeps the log fields, the slow-reader deadline
        and a cancelled write in this handler's own hands.
        """

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> None:
            with log_context(**self._fields(context, method)), await self._principal(context, method):
                try:
                    checked = _checked_stream(request) if client_streams else await _checked(request)
                    async with closing(behavior(checked, context)) as events:
                        async for event in events:
                            if not await self._write(context, event):
                                return
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await self._fail(context, method, exc)

        return guarded

    async def _write(self, context: grpc.aio.ServicerContext, message: Any) -> bool:
        """Send one message; False when the client has gone (nothing more to do, nothing to log)."""
        try:
            if self.slow_client_timeout_s is None:
                await context.write(message)
            else:
                async with reader_deadline(self.slow_client_timeout_s):
                    await context.write(message)
        except SlowReader as exc:
            log.info("%s stream dropped: %s", self.protocol, exc.message)
            raise
        except Exception as exc:  # grpc's ExecuteBatchError: the call ended under the write (a client cancel)
            log.debug("%s: a write failed, the call is over: %r", self.protocol, exc)
            return False
        return True

    def handlers(self, handlers: Mapping[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
        """The same method handlers, each guarded."""
        out: dict[str, grpc.RpcMethodHandler] = {}
        for method, handler in handlers.items():
            parse = _lenient(method, handler.request_deserializer)
            serialize = handler.response_serializer
            if handler.unary_unary is not None:
                out[method] = grpc.unary_unary_rpc_method_handler(
                    self.unary(method, handler.unary_unary), request_deserializer=parse, response_serializer=serialize
                )
            elif handler.unary_stream is not None:
                out[method] = grpc.unary_stream_rpc_method_handler(
                    self.streaming(method, handler.unary_stream, client_streams=False),
                    request_deserializer=parse,
                    response_serializer=serialize,
                )
            elif handler.stream_stream is not None:
                out[method] = grpc.stream_stream_rpc_method_handler(
                    self.streaming(method, handler.stream_stream, client_streams=True),
                    request_deserializer=parse,
                    response_serializer=serialize,
                )
            else:
                raise TypeError(f"{method}: client-streaming methods with a unary answer are not guarded")
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


def add_guarded(server: grpc.aio.Server, add_servicer: Callable[[Any, Any], None], servicer: Any, guard: Guard) -> str:
    """Register ``servicer`` through its generated ``add_servicer`` function, guarded; return its service name."""
    capture = _Capture()
    add_servicer(servicer, capture)
    if not capture.handlers:
        raise RuntimeError(f"{add_servicer.__name__} registered no method handlers")
    handlers = guard.handlers(capture.handlers)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)
    return capture.service
