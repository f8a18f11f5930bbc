"""The HTTP endpoints: auth, body, plan, run, and JSON or Server-Sent Events out.

Cancellation: when the client goes away the generation is cancelled, so the engine
stops decoding for nobody. Streaming responses get this, and the slow-reader rules, from
:mod:`.stream` (it stops the stream on ``http.disconnect``); the wait for the first event
and non-streaming requests race the work against ``http.disconnect`` themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from prismgate.codecs import json_input
from prismgate.codecs.openai.errors import OpenAIError, bad_request, from_gateway, to_openai
from prismgate.codecs.openai.formats import ChatFormat, CompletionFormat, Format, combine, dumps, merged
from prismgate.codecs.openai.generation import Generation, Piece
from prismgate.codecs.openai.plan import Plan, choice_plans, plan_chat, plan_completion
from prismgate.codecs.openai.request import Common, parse_chat, parse_completion
from prismgate.codecs.openai.stream import EventStream
from prismgate.core.errors import GatewayError
from prismgate.core.events import Done
from prismgate.core.memory import AnswerHold, hold_answer
from prismgate.core.service import SessionService
from prismgate.settings import Settings

T = TypeVar("T")
_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/sessions"}
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def error_response(exc: BaseException) -> Response:
    err = to_openai(exc)
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else err.headers()
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and raising ClientGone) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        # let cancelled work run its cleanup (closing the engine stream) before we go on
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class OpenAIEndpoints:
    def __init__(self, service: SessionService, settings: Settings) -> None:
        self.service = service
        self.settings = settings
        self.created = int(time.time())

    # -- helpers -------------------------------------------------------------------------

    async def _read(self, request: Request) -> bytes:
        """The body, up to ``openai_max_body_bytes``: refused from its Content-Length before a byte is read."""
        limit = self.settings.openai.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(f"{declared} bytes", limit)
        chunks: list[bytes] = []
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise _too_large(f"over {limit} bytes", limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _body(self, request: Request, raw: bytes | None = None) -> Any:
        raw = await self._read(request) if raw is None else raw
        try:
            return await json_input.loads_off_loop(raw, self.service.budget, "the request body")
        except GatewayError as exc:
            raise bad_request(exc.message) from None

    # -- completions ---------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, *, chat: bool) -> Response:
        # a non-streamed answer is built after its generation has ended: the generation's memory
        # budget bytes (which count that answer) stay held until it is written (HeldResponse)
        hold = hold_answer()
        response: Response | None = None
        try:
            response = await self._respond(request, chat=chat)
            return response
        finally:
            if not isinstance(response, HeldResponse):
                hold.release()
            else:
                response.hold = hold

    async def _respond(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await self._body(request)
            common: Common
            plan: Plan
            if chat:
                req = parse_chat(body)
                common = req.common
                plan = await plan_chat(self.service, self.settings, req)
            else:
                creq = parse_completion(body)
                common = creq.common
                plan = await plan_completion(self.service, self.settings, creq)
            plans = choice_plans(plan, common.n)
            generations = [Generation(self.service, p) for p in plans]
            await unless_disconnected(request, _start(generations))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return error_response(exc)
        kind = ChatFormat if chat else CompletionFormat
        fmts: list[Format] = [kind(plans[0], common.include_usage)]
        fmts += [kind(p, common.include_usage, index=i, first=fmts[0]) for i, p in enumerate(plans[1:], 1)]
        if common.stream:
            events = self._events(generations[0], fmts[0]) if common.n == 1 else _choices_events(generations, fmts)
            return cast(Response, EventStream(events, self.settings, dumps))
        try:
            pieces = await unless_disconnected(request, _collect_all(generations))
            if not (plan.want_logprobs or plan.axes is not None):
                return JSONResponse(_response(fmts, pieces, generations))
            # logprobs and readouts of every position can be tens of MB of JSON: built off the loop
            body = await asyncio.to_thread(_json, _response, fmts, pieces, generations)
            return HeldResponse(body, media_type="application/json")
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            return error_response(exc)

    @staticmethod
    async def _events(generation: Generation, fmt: Format) -> AsyncIterator[str]:
        pieces = generation.pieces()
        try:
            for chunk in fmt.head():
                yield dumps(chunk)
            async for piece in pieces:
                for payload in fmt.piece_payloads(piece):
                    yield payload
            assert generation.done is not None
            for chunk in fmt.tail(generation.done, generation.session_length):
                yield dumps(chunk)
            yield "[DONE]"
        except Exception as exc:  # after the 200 went out, an error is the stream's last event
            yield dumps(to_openai(exc).body())
        finally:
            await pieces.aclose()

    # -- models ----------------------------------------------------------------------------

    def _model(self, model_id: str) -> dict[str, Any]:
        out: dict[str, Any] = {"id": model_id, "object": "model", "created": self.created, "owned_by": "prismgate"}
        with contextlib.suppress(GatewayError):  # still loading: no details yet
            info = self.service.info(model_id)
            ext: dict[str, Any] = {"engine": info.engine_name, "max_model_len": info.max_model_len}
            if info.dtype:
                ext["dtype"] = {"name": info.dtype, "reason": info.dtype_reason}
            if info.readouts is not None:
                m = info.readouts
                ext["readouts"] = {
                    "layers": list(m.layers),
                    "concepts": list(m.concepts),
                    "hidden_size": m.hidden_size,
                    "dtype": m.dtype,
                    "layer_convention": m.layer_convention,
                    # [layer][concept] neutral points (null for packs without them); values stay raw
                    "centers": None if m.centers is None else [list(row) for row in m.centers],
                }
            if info.features is not None:  # the SAEs: their layers, widths and how many features have labels
                f = info.features
                ext["features"] = {
                    "layers": list(f.layers),
                    "features": list(f.widths),
                    "labelled": [len(labels) for labels in f.labels],
                }
            out["prismgate"] = ext
        return out

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model(m) for m in self.service.models.names]})

    async def get_model(self, request: Request) -> Response:
        try:
            model = self.service.models.resolve(request.path_params["model"])
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(self._model(model))

    # -- sessions (prismgate extension) -----------------------------------------------------

    async def _session(self, session_id: str) -> dict[str, Any]:
        try:
            session = await self.service.session(session_id)
        except GatewayError as exc:
            raise from_gateway(exc, param="session_id", code="session_not_found") from None
        return {
            "id": session.id,
            "object": "session",
            "model": session.model,
            "length": len(session),
            "busy": session.busy,
            "ttl_s": session.ttl_s,
        }

    async def open_session(self, request: Request) -> Response:
        try:
            raw = await self._read(request)
            body = await self._body(request, raw) if raw.strip() else {}
            if not isinstance(body, dict):
                raise bad_request("the request body must be a JSON object")
            model = body.get("model")
            if model is not None and not isinstance(model, str):
                raise bad_request("'model' must be a string", "model")
            session = await self.service.open(model)
            return JSONResponse({**(await self._session(session.id)), "created": int(time.time())})
        except Exception as exc:
            return error_response(exc)

    async def list_sessions(self, _request: Request) -> Response:
        """Every open session and the key that owns it: for a key with the admin scope (docs/keys.md)."""
        try:
            owners = await self.service.sessions()
            data = [{"id": sid, "object": "session", "owner": owner} for sid, owner in sorted(owners.items())]
            return JSONResponse({"object": "list", "data": data})
        except Exception as exc:
            return error_response(exc)

    async def get_session(self, request: Request) -> Response:
        try:
            return JSONResponse(await self._session(request.path_params["session_id"]))
        except Exception as exc:
            return error_response(exc)

    async def delete_session(self, request: Request) -> Response:
        try:
            session_id = request.path_params["session_id"]
            await self._session(session_id)  # 404 when unknown
            await self.service.close(session_id)
            return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})
        except Exception as exc:
            return error_response(exc)

    async def not_found(self, request: Request) -> Response:
        if request.url.path.rstrip("/") in _ENDPOINTS:
            return error_response(
                OpenAIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
            )
        return error_response(
            OpenAIError(
                404,
                f"Unknown endpoint {request.method} {request.url.path} (this server implements "
                "/v1/chat/completions, /v1/completions, /v1/models and /v1/sessions)",
                code="unknown_url",
            )
        )


class HeldResponse(Response):
    """A response that gives its generation's memory budget bytes back once it is sent (or the send failed)."""

    hold: AnswerHold | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.hold is not None:
                self.hold.release()


def _too_large(size: str, limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is {size}; this server accepts at most {limit} bytes (openai_max_body_bytes)",
        code="request_too_large",
    )


async def _collect(generation: Generation) -> list[Piece]:
    return [piece async for piece in generation.pieces()]


async def _start(generations: list[Generation]) -> None:
    """Start every choice's generation; if one is refused (or the wait is cancelled), none goes on.

    The first starts alone: its first event comes once the prompt is prefilled, and the others
    then start from its prefill (a :class:`~prismgate.core.actions.Fork`) instead of running it again.
    """
    try:
        await generations[0].start()
        results = await asyncio.gather(*(g.start() for g in generations[1:]), return_exceptions=True)
    except BaseException:
        await asyncio.gather(*(g.close() for g in generations))
        raise
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await asyncio.gather(*(g.close() for g in generations))
        raise failed[0]


async def _collect_all(generations: list[Generation]) -> list[list[Piece]]:
    """Every choice's pieces; the first failure stops the other choices and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_collect(g)) for g in generations]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [t.result() for t in tasks]


def _response(fmts: list[Format], pieces: list[list[Piece]], generations: list[Generation]) -> dict[str, Any]:
    """The non-streamed answer: one choice per generation, the usage of them all."""
    dones = [g.done for g in generations]
    assert all(d is not None for d in dones)
    done = cast(list[Done], dones)
    answers = [f.response(p, d, g.session_length) for f, p, d, g in zip(fmts, pieces, done, generations, strict=True)]
    return answers[0] if len(answers) == 1 else combine(answers, done)


async def _choices_events(generations: list[Generation], fmts: list[Format]) -> AsyncIterator[str]:
    """The SSE payloads of several choices: each choice's chunks in order, the choices interleaved as
    their tokens come; one usage chunk for them all at the end."""
    queue: asyncio.Queue[tuple[list[str], bool] | Exception] = asyncio.Queue(maxsize=2 * len(generations))

    async def run(generation: Generation, fmt: Format) -> None:
        pieces = generation.pieces()
        try:
            async for piece in pieces:
                await queue.put((fmt.piece_payloads(piece), False))
            assert generation.done is not None
            await queue.put(([dumps(fmt.finish(generation.done, None))], True))
        except Exception as exc:
            await queue.put(exc)
        finally:
            await pieces.aclose()

    tasks: list[asyncio.Task[None]] = []
    try:
        for fmt in fmts:
            for chunk in fmt.head():
                yield dumps(chunk)
        tasks = [asyncio.create_task(run(g, f)) for g, f in zip(generations, fmts, strict=True)]
        finished = 0
        while finished < len(tasks):
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            payloads, last = item
            for payload in payloads:
                yield payload
            finished += last
        if fmts[0].include_usage:
            dones = [g.done for g in generations if g.done is not None]
            yield dumps(fmts[0].usage_chunk(merged(dones), None))
        yield "[DONE]"
    except Exception as exc:  # after the 200 went out, an error is the stream's last event
        yield dumps(to_openai(exc).body())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


Handler = Callable[[Request], Awaitable[Response]]


def _json(build: Callable[..., Any], *args: Any) -> bytes:
    """``build(*args)`` encoded as :class:`JSONResponse` encodes it (called in a worker thread).

    In pieces: one ``json.dumps`` of a 21 MB answer is one C call that holds the interpreter
    lock throughout, and the event loop (``/healthz`` too) waits for it, worker thread or not.
    Objects and long lists are walked here, so the lock changes hands between their items.
    """
    out: list[str] = []
    _encode(build(*args), out)
    return "".join(out).encode()


LONG_LIST = 64  # lists longer than this are encoded item by item


def _encode(value: Any, out: list[str]) -> None:
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(("," if i else "") + _dumps(key) + ":")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, list) and len(value) > LONG_LIST:
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _encode(item, out)
        out.append("]")
    else:
        out.append(_dumps(value))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
