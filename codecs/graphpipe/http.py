"""The GraphPipe HTTP endpoint: body in, flatbuffer (or error) out.

* POST: the body is a raw flatbuffer ``Request`` whatever the Content-Type says (the
  Python client sends none, libcurl clients send a form type and ``Expect:
  100-continue``); InferRequest -> InferResponse, any other type -> MetadataResponse.
* GET: the metadata as JSON in the reference servers' key style.
* ``control/is_ready`` (only once the model is loaded) and ``control/is_alive``: ``ok``.

A body larger than ``graphpipe_max_body_bytes`` is refused from its Content-Length before
a byte of it is read (so an ``Expect: 100-continue`` client never sends it), or as soon
as a chunked body crosses the limit. Errors follow ``graphpipe_error_status``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from prismgate.codecs.graphpipe import wire
from prismgate.codecs.graphpipe.infer import run_plan
from prismgate.codecs.graphpipe.metadata import describe
from prismgate.codecs.graphpipe.outputs import RowResult, assemble
from prismgate.codecs.graphpipe.plan import make_plan
from prismgate.codecs.status import http_status as status_of
from prismgate.core.errors import Code, GatewayError
from prismgate.core.service import SessionService
from prismgate.settings import Settings

log = logging.getLogger(__name__)

OCTET = "application/octet-stream"


class BodyTooLarge(GatewayError):
    """RESOURCE_EXHAUSTED, sent as 413 when errors go out as HTTP statuses."""

    def __init__(self, limit: int, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else f"over {limit} bytes (sent chunked)"
        super().__init__(
            Code.RESOURCE_EXHAUSTED,
            f"request body is {size}; this server accepts at most {limit} bytes (graphpipe_max_body_bytes)",
        )


def http_status(error: GatewayError) -> int:
    """The status from the gateway's one table, refined to 413 for a body over the size limit."""
    return 413 if isinstance(error, BodyTooLarge) else status_of(error.code)


def wants_http_errors(policy: str, request: Request) -> bool:
    """The status policy: see ``graphpipe_error_status`` and docs/graphpipe.md."""
    if policy == "auto":
        return request.headers.get("user-agent", "").startswith("Go-http-client/")
    return policy == "http"


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise GatewayError(Code.INVALID_ARGUMENT, f"Content-Length {declared[:40]!r} is not a number") from None
        if length > limit:
            raise BodyTooLarge(limit, length)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge(limit, None)
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (only call after the body is read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GraphPipeEndpoint:
    """One model's GraphPipe endpoint (``model`` None: the default model's)."""

    def __init__(self, service: SessionService, settings: Settings, model: str | None = None) -> None:
        self.service = service
        self.settings = settings
        self.model = model
        self._metadata: tuple[object, wire.Metadata] | None = None

    def metadata(self) -> wire.Metadata:
        self.service.models.require_ready()
        info = self.service.info(self.model)
        if self._metadata is None or self._metadata[0] is not info:
            self._metadata = (info, describe(info))
        return self._metadata[1]

    async def handle(self, request: Request) -> Response:
        if request.method == "GET":
            return await self.get(request)
        return await self.post(request)

    async def get(self, request: Request) -> Response:
        try:
            return JSONResponse(wire.metadata_json(self.metadata()))
        except GatewayError as exc:
            return JSONResponse({"error": exc.message, "code": int(exc.code)}, status_code=http_status(exc))

    async def post(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.settings.graphpipe.max_body_bytes)
            return Response(await self.answer(body, request), media_type=OCTET)
        except ClientDisconnect:
            return Response(status_code=499)
        except GatewayError as exc:
            return self.error(exc, request)
        except Exception as exc:  # a bug: still answer with a message, keep serving
            log.exception("graphpipe request failed")
            return self.error(GatewayError(Code.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"), request)

    async def answer(self, body: bytes, request: Request) -> bytes:
        # verifying and decoding cost time in proportion to the body: off the event loop
        call = await asyncio.to_thread(wire.decode_request, body, self.settings.graphpipe.max_batch)
        if call is None:
            return wire.encode_metadata(self.metadata())
        self.service.models.require_ready()
        plan = await make_plan(self.service, call, self.settings.graphpipe.max_batch, self.model)
        results = await _unless_disconnected(request, lambda: run_plan(self.service, plan))
        return wire.encode_outputs(assemble(plan.shape, results, self.service.info(self.model).readouts))

    def error(self, exc: GatewayError, request: Request) -> Response:
        log.info("graphpipe error %s: %s", exc.code.name, exc.message)
        retry = None if exc.retry_after_s is None else {"retry-after": str(int(exc.retry_after_s))}
        if wants_http_errors(self.settings.graphpipe.error_status, request):
            # counted by the middleware
            return PlainTextResponse(exc.message + "\n", status_code=http_status(exc), headers=retry)
        if not exc.reported:  # a 200 carrying an error: the middleware sees only the 200
            self.service.monitor.refused("graphpipe", exc.code)
        return Response(wire.encode_errors([(int(exc.code), exc.message)]), media_type=OCTET, headers=retry)


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable[list[RowResult]]]) -> list[RowResult]:
    """Run ``work`` but cancel it (CANCELLED) if the client disconnects first."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise GatewayError(Code.CANCELLED, "the client went away before the answer was ready")
    return task.result()


async def is_alive(_request: Request) -> Response:
    return PlainTextResponse("ok\n")


def is_ready_endpoint(service: SessionService) -> Callable[[Request], Awaitable[Response]]:
    async def is_ready(_request: Request) -> Response:
        if service.models.ready:
            return PlainTextResponse("ok\n")
        return PlainTextResponse("not ready\n", status_code=503)

    return is_ready
