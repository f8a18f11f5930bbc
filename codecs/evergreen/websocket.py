"""Evergreen over WebSocket at ``/evergreen``: one connection is one session.

Frames: a text frame holds one ``SessionMessage`` in proto3 JSON (camelCase), a binary
frame one ``SessionMessage`` in protobuf binary (a binary frame that starts with ``{`` is
read as JSON), or one ActionEngine ``WireMessage`` (a binary frame that starts with a
msgpack ``bin`` header, :func:`~prismgate.codecs.actionengine.wire.looks_like_wire`; see
:mod:`prismgate.codecs.actionengine`). Replies use the form of the client's first frame;
an ActionEngine connection takes ActionEngine frames only. Auth: the shared bearer
token in the ``Authorization`` header or, for browsers (which cannot set headers on a
WebSocket), the ``access_token`` query parameter. Aborts close the socket with the code
and reason of :mod:`prismgate.codecs.evergreen.errors`; each abort is counted in the
errors metric (``monitor.refused``) unless it ended a generation the monitor already saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, cast

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from starlette.websockets import WebSocket, WebSocketDisconnect

from prismgate.codecs import json_input
from prismgate.codecs.actionengine import refusal as actionengine_refusal
from prismgate.codecs.actionengine import translate
from prismgate.codecs.actionengine import wire as ae_wire
from prismgate.codecs.actionengine.link import Link
from prismgate.codecs.evergreen.errors import close_reason
from prismgate.codecs.evergreen.json_frames import to_json
from prismgate.codecs.evergreen.session import EvergreenSession, Options
from prismgate.codecs.outflow import SlowReader, reader_deadline
from prismgate.codecs.status import close_code
from prismgate.core.budget import RequestBudget
from prismgate.core.errors import GatewayError, invalid
from prismgate.core.service import SessionService
from prismgate.schemas import evergreen_pb2 as pb

log = logging.getLogger(__name__)

PROTOCOL = "evergreen"


def decode_frame(message: Mapping[str, Any], frame: int, budget: RequestBudget) -> tuple[pb.SessionMessage, bool]:
    """(message, is_json) from one ASGI websocket.receive event; JSON is checked against the budget first."""
    text = message.get("text")
    raw = message.get("bytes")
    if isinstance(raw, bytes) and raw.lstrip()[:1] == b"{":
        text, raw = raw.decode("utf-8", errors="replace"), None
    if isinstance(text, str):
        try:
            return json_input.checked(text, budget, f"frame {frame}", _parse_json), True
        except json_format.ParseError as exc:
            raise invalid(f"frame {frame}: not a SessionMessage in proto3 JSON: {exc}") from None
    if isinstance(raw, bytes):
        out = pb.SessionMessage()
        try:
            out.ParseFromString(raw)
        except DecodeError as exc:
            raise invalid(f"frame {frame}: not a SessionMessage in protobuf binary: {exc}") from None
        return out, False
    raise invalid(f"frame {frame}: empty WebSocket message")


def _parse_json(text: str) -> pb.SessionMessage:
    return json_format.Parse(text, pb.SessionMessage())


def encode(message: pb.SessionMessage, as_json: bool) -> str | bytes:
    if as_json:
        return to_json(message)
    return message.SerializeToString()


class EvergreenEndpoint:
    def __init__(self, service: SessionService, options: Options) -> None:
        self.service = service
        self.options = options

    @property
    def ae_limits(self) -> ae_wire.Limits:
        """What one ActionEngine frame may hold: the session's node limits and the request budget."""
        budget = self.service.budget
        text_bytes = budget.prompt_bytes_per_context_token * budget.context
        return ae_wire.Limits(
            max_chunk_bytes=max(text_bytes, self.options.refs.max_bytes),
            max_fragments=self.options.limits.max_nodes,
            max_actions=budget.max_actions_in_flight,
        )

    async def handle(self, websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            self.service.models.require_ready()
            session = EvergreenSession(self.service, self.options)
        except GatewayError as exc:
            await actionengine_refusal.report(websocket, exc)  # an ActionEngine client reads it from its actions
            await self._abort(websocket, exc)
            return
        try:
            await self._serve(websocket, session)
        finally:
            await session.close()

    async def _serve(self, websocket: WebSocket, session: EvergreenSession) -> None:
        form: list[bool] = []  # the client's first frame form: True = JSON
        links: list[Link] = []  # the ActionEngine side, when the first frame was ActionEngine's

        async def read() -> None:
            frame = 0
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                frame += 1
                try:
                    raw = message.get("bytes")
                    if (isinstance(raw, bytes) and ae_wire.looks_like_wire(raw)) or links:
                        first = not form
                        form[:] = [False]
                        if not await self._feed_actionengine(message, frame, session, links, first):
                            return
                        continue
                    size = len(message.get("text") or message.get("bytes") or "")
                    decoded, is_json = await json_input.off_loop(
                        size, decode_frame, message, frame, self.service.budget
                    )
                    if not form:
                        form.append(is_json)
                    session.feed(decoded)
                except GatewayError as exc:
                    session.fail(exc)
                    return

        async def write() -> None:
            while True:
                message = await session.outbox.get()
                if message is None:
                    return
                payload = links[0].writer.encode(message) if links else encode(message, form[0] if form else True)
                if payload is None:
                    continue
                async with self._deadline():
                    if isinstance(payload, str):
                        await websocket.send_text(payload)
                    else:
                        await websocket.send_bytes(payload)

        reader = asyncio.create_task(read())
        writer = asyncio.create_task(write())
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if links and links[0].half_closed and reader.done() and not session.failed.done():
                await asyncio.wait({writer})  # it ends at the end marker, each send under the client's deadline
            if writer.done() and isinstance(writer.exception(), SlowReader):
                await self._drop(websocket, session, cast(SlowReader, writer.exception()))
            elif session.failed.done():
                error = session.failed.result()
                reader.cancel()
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(writer, timeout=30)  # send what came before the failure
                log.info("evergreen session aborted: %s", error)
                await self._abort(websocket, error, links[0] if links else None)
            elif writer.done() and links and links[0].half_closed:  # every action ended after the half-close
                async with self._deadline():
                    await websocket.send_bytes(links[0].writer.half_close())
                await websocket.close(code=1000)
        except (WebSocketDisconnect, RuntimeError, OSError, SlowReader):
            pass
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            for link in links:
                await link.close()

    async def _feed_actionengine(
        self, message: Mapping[str, Any], frame: int, session: EvergreenSession, links: list[Link], first: bool
    ) -> bool:
        """Decode one ActionEngine frame (off the loop when large) and apply it; False once the client half-closed."""
        raw = message.get("bytes")
        where = f"frame {frame}"
        if not isinstance(raw, bytes) or not ae_wire.looks_like_wire(raw):
            raise invalid(f"{where}: this connection speaks ActionEngine (its first frame did); not a WireMessage")
        if not first and not links:
            raise invalid(f"{where}: an ActionEngine frame on a connection that began in Evergreen's form")
        decoded = await json_input.off_loop(len(raw), translate.inbound, raw, self.ae_limits, where)
        if not links:
            links.append(Link(session, decoded.form))
        links[0].feed(decoded)
        if decoded.half_close:
            await links[0].finish()
            return False
        return True

    def _deadline(self) -> contextlib.AbstractAsyncContextManager[None]:
        timeout = self.options.slow_client_timeout_s
        return contextlib.nullcontext() if timeout is None else reader_deadline(timeout)

    async def _drop(self, websocket: WebSocket, session: EvergreenSession, error: SlowReader) -> None:
        """A client that stopped reading: stop its actions now, then close (the server's WebSocket
        gives up on the closing handshake after its close timeout and drops the connection)."""
        log.info("evergreen session dropped: %s", error.message)
        await session.close()
        await self._abort(websocket, error)

    async def _abort(self, websocket: WebSocket, error: GatewayError, link: Link | None = None) -> None:
        if not error.reported:  # an error that ended a generation was counted by its monitor
            self.service.monitor.refused(PROTOCOL, error.code)
        with contextlib.suppress(Exception):
            report = link.writer.failure(error) if link is not None else None
            if report is not None:  # an ActionEngine client reads why from its actions' status nodes
                async with self._deadline():
                    await websocket.send_bytes(report)
        with contextlib.suppress(Exception):
            await websocket.close(code=close_code(error.code), reason=close_reason(error))
