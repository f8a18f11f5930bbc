"""One OpenAI request -> one core GenerateAction, and its events -> text pieces.

Both endpoints come here once their body is parsed: this module resolves the model
and the session, renders the prompt (chat messages through the shared
:mod:`prismgate.core.chat`), picks ``max_tokens`` the way OpenAI does (the rest of the
context when the client sets none), builds the :class:`GenerateAction` and turns the
core's token events into :class:`Piece` s: text that is safe to show, with the tokens
that produced it (their logprobs and readouts). The two wire formats only differ in
how they print pieces (``chat.py``, ``completions.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from prismgate.codecs.openai.errors import OpenAIError, bad_request, from_gateway
from prismgate.codecs.openai.request import ChatRequest, Common, CompletionRequest, ReadoutRequest, select
from prismgate.codecs.openai.tokens import TokenTexts
from prismgate.core.actions import GenerateAction, GenerateSpec, ImageInput, PositionRange
from prismgate.core.chat import render, render_continuation
from prismgate.core.engine import EngineInfo
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.core.service import SessionService
from prismgate.settings import Settings

ORIGIN = "openai"
# core errors raised while an action is validated, before it changes the session
_BEFORE_APPEND = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.FAILED_PRECONDITION,
        Code.ABORTED,
        Code.RESOURCE_EXHAUSTED,
        Code.UNAUTHENTICATED,
    }
)
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a probability that underflows; JSON has no -inf


@dataclass(frozen=True, slots=True)
class ReadoutAxes:
    """The requested slice of the readout manifest: model layer numbers and concept names."""

    layers: tuple[int, ...]
    concepts: tuple[str, ...]
    layer_index: tuple[int, ...]
    concept_index: tuple[int, ...]

    def describe(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "concepts": list(self.concepts)}

    def take(self, readout: np.ndarray) -> list[list[float]]:
        part = readout[np.ix_(self.layer_index, self.concept_index)]
        # str() of a float32 is its shortest round-trip form: exact, and short on the wire
        return [[float(str(v)) for v in row] for row in part]


@dataclass(slots=True)
class Token:
    """One token of the output (or of the echoed prompt), ready to print."""

    id: int
    position: int
    text: str
    bytes: list[int]
    logprob: float | None = None
    top: list[tuple[str, list[int], float]] | None = None
    readout: list[list[float]] | None = None


@dataclass(slots=True)
class Piece:
    """Text released at once, and the tokens behind it (often one token, one piece)."""

    text: str
    tokens: list[Token] = field(default_factory=list)


@dataclass(slots=True)
class Plan:
    """Everything decided before the engine runs."""

    model: str
    action: GenerateAction
    session_id: str | None
    base: int  # session length before this request (0 without a session)
    prompt_len: int  # where decoding starts: base + appended tokens
    echo_text: str | None  # completions with echo: the prompt as text
    axes: ReadoutAxes | None
    want_logprobs: bool


class Generation:
    """Runs a :class:`Plan` and yields pieces; ``done`` holds the core's Done when it ends."""

    def __init__(self, service: SessionService, plan: Plan, texts: TokenTexts, info: EngineInfo) -> None:
        self.service = service
        self.plan = plan
        self.texts = texts
        self.info = info
        self.done: Done | None = None
        self.session_length: int | None = None
        self._stream: AsyncIterator[Event] | None = None
        self._first: Event | None = None
        self._applied = False  # whether this request's append reached the session

    async def start(self) -> None:
        """Submit the action and wait for its first event, so that rejections become HTTP errors."""
        plan = self.plan
        if plan.session_id is not None:
            self._stream = self.service.generate(plan.session_id, plan.action)
        else:
            self._stream = self.service.run(plan.action, model=plan.model)
        try:
            self._first = await anext(self._stream)
        except BaseException as exc:
            # Validation failures leave the session untouched; anything later (queue full,
            # engine error, client gone) happens after the append, which is then undone.
            self._applied = not (isinstance(exc, GatewayError) and exc.code in _BEFORE_APPEND)
            await self.close(finished=False)
            raise
        self._applied = True

    async def pieces(self) -> AsyncIterator[Piece]:
        assert self._stream is not None, "start() first"
        stream, finished = self._stream, False
        prompt: list[Token] = []
        pending: list[Token] = []
        echo_sent = self.plan.echo_text is None
        try:
            event: Event | None = self._first
            while event is not None:
                if isinstance(event, Done):
                    self.done = event
                    # the turn is committed to the session once the engine finished it
                    finished = event.finish_reason is not FinishReason.CANCELLED
                    break
                if event.is_prefill:
                    prompt.append(self._token(event))
                else:
                    if not echo_sent:
                        echo_sent = True
                        yield Piece(self.plan.echo_text or "", prompt)
                    pending.append(self._token(event))
                    if event.text:
                        yield Piece(event.text, pending)
                        pending = []
                event = await anext(stream, None)
            if self.done is None:
                raise GatewayError(Code.INTERNAL, "the generation ended without a Done event")
            if not echo_sent:
                yield Piece(self.plan.echo_text or "", prompt)
            if self.done.finish_reason is FinishReason.EOS and pending and self._is_stop_token(pending[-1].id):
                pending.pop()  # the end-of-turn token is not part of the answer
            text = self.done.text or ""
            if text or pending:
                yield Piece(text, pending)
        finally:
            await self.close(finished=finished)

    async def close(self, *, finished: bool) -> None:
        """Release the stream; a session turn that did not finish is rewound to where it began."""
        stream, self._stream = self._stream, None
        with anyio.CancelScope(shield=True):  # runs even when the client left and the task is cancelled
            if stream is not None:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            if self.plan.session_id is not None:
                if not finished and self._applied:
                    await self._rewind()
                with contextlib.suppress(GatewayError):
                    self.session_length = len(self.service.session(self.plan.session_id))

    async def _rewind(self) -> None:
        """Undo this request's append, so a failed or abandoned turn leaves the session as it was."""
        assert self.plan.session_id is not None
        action = GenerateAction(offset=self.plan.base, truncating=True, spec=GenerateSpec(max_tokens=0), origin=ORIGIN)
        with contextlib.suppress(GatewayError):
            session = self.service.session(self.plan.session_id)
            appended = self.plan.action.append_tokens
            ours = tuple(session.tokens[self.plan.base : self.plan.base + len(appended)]) == appended
            if len(session) <= self.plan.base or session.busy or not ours:
                return
            stream = self.service.generate(self.plan.session_id, action)
            try:
                async for _ in stream:
                    pass
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()

    def _is_stop_token(self, token_id: int) -> bool:
        return token_id in self.info.eos_token_ids or token_id in self.plan.action.spec.stop_token_ids

    def _token(self, event: TokenEvent) -> Token:
        text, raw = self.texts.get(event.id)
        token = Token(event.id, event.position, text, raw)
        if self.plan.want_logprobs:
            token.logprob = None if event.logprob is None else _finite(event.logprob)
            if event.top_logprobs is not None:
                token.top = [(*self.texts.get(i), _finite(lp)) for i, lp in event.top_logprobs]
        if self.plan.axes is not None and event.readout is not None:
            token.readout = self.plan.axes.take(event.readout)
        return token


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def plan_chat(service: SessionService, settings: Settings, req: ChatRequest) -> tuple[Plan, EngineInfo]:
    info, session_tokens = _resolve(service, req.common)
    try:
        if req.common.session_id is None:
            prompt = render(service, req.messages, model=info.model_id)
        else:
            prompt = render_continuation(service, session_tokens, req.messages, model=info.model_id)
    except GatewayError:
        raise
    except Exception as exc:  # a template that raises (roles out of order, say) was given bad input
        raise bad_request(f"the model's chat template rejected the messages: {exc}", "messages") from None
    return _plan(settings, info, req.common, len(session_tokens), prompt.tokens, None, prompt.images), info


def plan_completion(service: SessionService, settings: Settings, req: CompletionRequest) -> tuple[Plan, EngineInfo]:
    info, session_tokens = _resolve(service, req.common)
    if isinstance(req.prompt, str):
        append = info.tokenizer.encode(req.prompt)
        echo = req.prompt
    else:
        append = list(req.prompt)
        bad = [t for t in append if not 0 <= t < info.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} in 'prompt' is outside the vocabulary [0, {info.vocab_size})", "prompt"
            )
        echo = info.tokenizer.decode(append)
    return _plan(settings, info, req.common, len(session_tokens), append, echo if req.echo else None, ()), info


def _resolve(service: SessionService, common: Common) -> tuple[EngineInfo, list[int]]:
    """The model's info and the session's current tokens (empty without a session)."""
    if common.model not in service.pool.models:
        raise OpenAIError(
            404,
            f"The model '{common.model}' does not exist; this server serves "
            + ", ".join(repr(m) for m in service.pool.models),
            param="model",
            code="model_not_found",
        )
    info = service.info(common.model)
    if common.session_id is None:
        return info, []
    try:
        session = service.session(common.session_id)
    except GatewayError as exc:
        raise from_gateway(exc, param="session_id", code="session_not_found") from None
    if session.model != info.model_id:
        raise bad_request(
            f"session {common.session_id!r} is bound to model {session.model!r}, not {common.model!r}", "model"
        )
    return info, list(session.tokens)


def _plan(
    settings: Settings,
    info: EngineInfo,
    common: Common,
    base: int,
    append: Sequence[int],
    echo: str | None,
    images: tuple[ImageInput, ...],
) -> Plan:
    prompt_len = base + len(append)
    limit = info.max_model_len
    room = limit - prompt_len
    if room <= 0 or (common.max_tokens is not None and common.max_tokens > room):
        wanted = common.max_tokens if common.max_tokens is not None else 1
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + wanted} tokens ({prompt_len} in the prompt{' and session' if base else ''}, "
            f"{wanted} in the completion). Please reduce the length of the messages or completion.",
            "messages" if echo is None else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = common.max_tokens
    if max_tokens is None:
        default = settings.openai_default_max_tokens
        max_tokens = room if default is None else min(default, room)
    first = base if echo is not None else prompt_len  # echo reports the prompt's tokens too
    horizon = PositionRange(first, prompt_len + max_tokens)
    axes = _axes(info, common.readouts)
    spec = GenerateSpec(
        max_tokens=max_tokens,
        temperature=common.temperature,
        top_p=common.top_p,
        top_k=common.top_k,
        seed=common.seed,
        stop_strings=common.stop,
        logprob_ranges=(horizon,) if common.top_logprobs is not None else (),
        logprob_top_k=common.top_logprobs or 0,
        readout_ranges=(horizon,) if axes is not None else (),
    )
    action = GenerateAction(
        append_tokens=tuple(append),
        images=images,
        offset=base if common.session_id is not None else None,
        spec=spec,
        detokenize=True,
        origin=ORIGIN,
    )
    return Plan(
        model=common.model,
        action=action,
        session_id=common.session_id,
        base=base,
        prompt_len=prompt_len,
        echo_text=echo,
        axes=axes,
        want_logprobs=common.top_logprobs is not None,
    )


def _axes(info: EngineInfo, wanted: ReadoutRequest | None) -> ReadoutAxes | None:
    if wanted is None:
        return None
    manifest = info.readouts
    if manifest is None:
        raise bad_request(f"model {info.model_id!r} has no concept pack loaded, so it has no readouts", "readouts")
    li = select(manifest.layers, wanted.layers, "layers", "readouts.layers")
    ci = select(manifest.concepts, wanted.concepts, "concepts", "readouts.concepts")
    return ReadoutAxes(
        layers=tuple(manifest.layers[i] for i in li),
        concepts=tuple(manifest.concepts[i] for i in ci),
        layer_index=li,
        concept_index=ci,
    )
