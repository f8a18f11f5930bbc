"""A refused ``/evergreen`` connection (no key, a wrong one): an ActionEngine client learns why from its actions.

The library's client ignores close codes: refused at the handshake or closed at once, its
``await`` on an output would wait until the caller gives up. So before the refusal closes
the socket, :func:`report` reads the client's first frame (at most ``WAIT_S``, a small
frame, decoded under tight limits) and, when it is an ActionEngine frame with actions,
writes the refusal to each action's outputs and status. Evergreen clients see the same
close code and reason as before, after their first frame (or ``WAIT_S``); a page (a socket
that sent an ``Origin``) is closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.websockets import WebSocket

from prismgate.codecs.actionengine import translate, wire
from prismgate.core.errors import GatewayError

WAIT_S = 1.0
MAX_FRAME_BYTES = 64 * 1024
LIMITS = wire.Limits(max_frame_bytes=MAX_FRAME_BYTES, max_chunk_bytes=MAX_FRAME_BYTES, max_fragments=64, max_actions=16)


async def report(websocket: WebSocket, error: GatewayError) -> None:
    """Write ``error`` to the actions of an ActionEngine client's first frame (nothing for other clients)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(WAIT_S):
            message = await websocket.receive()
            raw = message.get("bytes")
            if not isinstance(raw, bytes) or len(raw) > MAX_FRAME_BYTES or not wire.looks_like_wire(raw):
                return
            decoded = translate.inbound(raw, LIMITS, "frame 1")
            writer = translate.Writer(decoded.form)
            for call in decoded.calls:
                writer.track(call)
            frame = writer.failure(error)
            if frame is not None:
                await websocket.send_bytes(frame)
