"""The request-body read timeout (nginx's ``client_body_timeout``), which uvicorn does not have.

A client that sends its headers and then dribbles its body, or stops sending it, would
hold a handler (and its memory) for as long as it likes. Every wait for the next piece of
a body is bounded by ``http_body_timeout_s``; past it the client gets ``408`` in its wire's
form, the connection closes, and the route sees the client as gone (``http.disconnect``).
Once the body is complete, waits (a handler watching for the client to leave) are not
bounded: the response is then the route's business.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prismgate.core.errors import Code
from prismgate.edge.refusals import Refusal, refuse


class BodyTimeout:
    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False
        started = False
        answered = False

        async def timed_receive() -> Message:
            nonlocal body_done, answered
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                body_done = True
                if not started:
                    answered = True
                    reason = f"no request body data for {self.timeout_s:g}s (http_body_timeout_s)"
                    await refuse(scope, receive, send, Refusal(Code.RESOURCE_EXHAUSTED, reason, 408))
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:
                return  # we answered already; the route's late answer goes nowhere
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, timed_receive, guarded_send)
