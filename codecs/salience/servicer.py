"""The salience.v1.Salience servicer: each RPC is one SessionService call, translated.

Errors are raised as :class:`GatewayError` and turned into statuses by the guard in
:mod:`prismgate.codecs.grpc_guard`; nothing here decides policy.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from prismgate.codecs.grpc_guard import closing, metadata
from prismgate.codecs.outflow import Outflow
from prismgate.codecs.salience import convert
from prismgate.core.events import Event, TokenEvent
from prismgate.core.service import SessionService
from prismgate.schemas import salience_pb2 as pb
from prismgate.schemas import salience_pb2_grpc as pb_grpc


class SalienceServicer(pb_grpc.SalienceServicer):
    def __init__(self, service: SessionService, buffer_bytes: int = 1024 * 1024) -> None:
        self.service = service
        self.buffer_bytes = buffer_bytes  # what a Generate may hold for a slow reader (see prismgate.codecs.outflow)

    async def OpenSession(
        self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenSessionResponse:
        session = await self.service.open(request.model)
        return pb.OpenSessionResponse(
            session_id=session.id, max_model_len=self.service.info(session.model).max_model_len
        )

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        await self.service.close(request.session_id)
        return pb.CloseSessionResponse()

    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForkSessionResponse:
        child = await self.service.fork(request.session_id, request.at_position)
        return pb.ForkSessionResponse(session_id=child.id)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        # counts first: a million two-byte ranges must not become a million objects
        self.service.budget.check_lists(
            stop_token_ids=len(request.stop_token_ids),
            logprob_ranges=len(request.logprobs_ranges),
            readout_ranges=len(request.readout_ranges),
        )
        options = convert.metadata_options(
            metadata(context, convert.DETERMINISTIC_KEY), metadata(context, convert.SEED_KEY)
        )
        action = convert.action_from_request(request, **options)
        events = _messages(self.service.generate(request.session_id, action))
        async with Outflow(events, pb.GenerateEvent.ByteSize, self.buffer_bytes) as messages:
            async for message in messages:
                yield message

    async def GetReadoutManifest(
        self, request: pb.GetReadoutManifestRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReadoutManifest:
        return convert.manifest(self.service.info().readouts)

    async def DumpSession(
        self, request: pb.DumpSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DumpSessionResponse:
        return pb.DumpSessionResponse(tokens=await self.service.dump(request.session_id))


async def _messages(events: AsyncGenerator[Event, None]) -> AsyncIterator[pb.GenerateEvent]:
    async with closing(events):
        async for event in events:
            yield convert.token_event(event) if isinstance(event, TokenEvent) else convert.done_event(event)
