"""Evergreen over gRPC: ``evergreen.v2.EvergreenService/StartSession``, one stream = one session.

The same :class:`EvergreenSession` as the WebSocket, behind the guard every gRPC service
of the gateway runs inside (:mod:`prismgate.codecs.grpc_guard`: bearer token, request-id
logging, lenient parsing, statuses from the one table). When the client half-closes, the
running actions finish and the server ends the stream with OK; an abort ends it with the
error's status code and message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from prismgate.codecs.evergreen.session import EvergreenSession, Options
from prismgate.codecs.grpc_guard import Guard, add_guarded
from prismgate.core.errors import Code, GatewayError
from prismgate.core.service import SessionService
from prismgate.keys import KeyRing
from prismgate.schemas import evergreen_pb2 as pb
from prismgate.schemas import evergreen_pb2_grpc

PROTOCOL = "evergreen"


class EvergreenServicer(evergreen_pb2_grpc.EvergreenServiceServicer):
    def __init__(self, service: SessionService, options: Options) -> None:
        self.service = service
        self.options = options

    async def StartSession(
        self, request_iterator: AsyncIterator[pb.SessionMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SessionMessage]:
        self.service.models.require_ready()
        session = EvergreenSession(self.service, self.options)

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
                raise session.failed.result()  # the guard turns it into the stream's status
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            await session.close()


def add(server: grpc.aio.Server, service: SessionService, options: Options, keys: KeyRing) -> str:
    guard = Guard(service, PROTOCOL, keys, slow_client_timeout_s=options.slow_client_timeout_s)
    return add_guarded(
        server, evergreen_pb2_grpc.add_EvergreenServiceServicer_to_server, EvergreenServicer(service, options), guard
    )
