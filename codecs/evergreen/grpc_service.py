"""Evergreen over gRPC: ``evergreen.v2.EvergreenService/StartSession``, one stream = one session.

The same :class:`EvergreenSession` as the WebSocket. When the client half-closes, the
running actions finish and the server ends the stream with OK; an abort ends it with the
error's status code and message. Auth: the shared bearer token in ``authorization`` metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from prismgate.auth import check_bearer
from prismgate.codecs.evergreen.session import EvergreenSession, Options
from prismgate.core.errors import Code, GatewayError
from prismgate.core.service import SessionService
from prismgate.schemas import evergreen_pb2 as pb
from prismgate.schemas import evergreen_pb2_grpc

SERVICE_NAME = "evergreen.v2.EvergreenService"
_STATUS = {s.value[0]: s for s in grpc.StatusCode}


def status_of(code: Code) -> grpc.StatusCode:
    return _STATUS.get(int(code), grpc.StatusCode.INTERNAL)


class EvergreenServicer(evergreen_pb2_grpc.EvergreenServiceServicer):
    def __init__(self, service: SessionService, options: Options, auth_token: str | None) -> None:
        self.service = service
        self.options = options
        self.auth_token = auth_token

    async def StartSession(
        self, request_iterator: AsyncIterator[pb.SessionMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionMessage]:
        try:
            metadata = dict(context.invocation_metadata() or ())
            check_bearer(self.auth_token, metadata.get("authorization"))
            if not self.service.pool.ready:
                raise GatewayError(Code.UNAVAILABLE, "the model is still loading; retry once the server reports ready")
            session = EvergreenSession(self.service, self.options)
        except GatewayError as exc:
            await context.abort(status_of(exc.code), exc.message)
            return

        async def read() -> None:
            try:
                async for message in request_iterator:
                    session.feed(message)
            except GatewayError as exc:
                session.fail(exc)
                return
            except Exception as exc:
                session.fail(GatewayError(Code.CANCELLED, f"the client stream failed: {type(exc).__name__}"))
                return
            await session.finish()

        reader = asyncio.create_task(read())
        try:
            while True:
                message = await session.outbox.get()
                if message is None:
                    break
                yield message
            if session.failed.done():
                error = session.failed.result()
                await context.abort(status_of(error.code), error.message)
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            await session.close()


def add(server: grpc.aio.Server, service: SessionService, options: Options, auth_token: str | None) -> str:
    evergreen_pb2_grpc.add_EvergreenServiceServicer_to_server(EvergreenServicer(service, options, auth_token), server)
    return SERVICE_NAME
