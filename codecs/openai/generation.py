"""A planned OpenAI request, run: the core's events -> text pieces.

The core's token events become :class:`Piece` s: text that is safe to show, with the
tokens that produced it (their logprobs and readouts). The two wire formats only differ
in how they print pieces (:mod:`.formats`). What a failed or abandoned turn leaves in a
session is the core's rule (a chat turn is all or nothing, :mod:`prismgate.core.turns`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import anyio
import numpy as np
import numpy.typing as npt

from prismgate.codecs.openai.errors import from_gateway
from prismgate.codecs.openai.plan import Plan
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.core.features import Features
from prismgate.core.service import SessionService
from prismgate.core.structured import GrammarRefused
from prismgate.core.token_texts import TokenTexts

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a probability that underflows; JSON has no -inf


@dataclass(slots=True)
class Token:
    """One token of the output (or of the echoed prompt), ready to print."""

    id: int
    position: int
    text: str
    bytes: list[int]
    logprob: float | None = None
    top: list[tuple[str, list[int], float]] | None = None
    top_ids: list[int] | None = None  # the ids of ``top``, in order
    readout: npt.NDArray[np.float32] | None = None  # the requested layers x concepts
    features: Features | None = None  # SAE features, when asked


@dataclass(slots=True)
class Piece:
    """Text released at once, and the tokens behind it (often one token, one piece)."""

    text: str
    tokens: list[Token] = field(default_factory=list)


class Generation:
    """Runs a :class:`Plan` and yields pieces; ``done`` holds the core's Done when it ends."""

    def __init__(self, service: SessionService, plan: Plan) -> None:
        self.service = service
        self.plan = plan
        self.texts: TokenTexts = service.token_texts(plan.turn.model)
        spec = plan.turn.action.spec
        # the stop token that ended the answer is part of it only with include_stop_str_in_output
        eos = service.info(plan.turn.model).eos_token_ids
        self._stop_ids = frozenset() if spec.stop_token_text else spec.stop_ids(eos)
        self.done: Done | None = None
        self.session_length: int | None = None
        self._stream: AsyncGenerator[Event, None] | None = None
        self._first: Event | None = None

    async def start(self) -> None:
        """Submit the turn and wait for its first event, so that rejections become HTTP errors."""
        self._stream = self.service.run_turn(self.plan.turn)
        try:
            self._first = await anext(self._stream)
        except GrammarRefused as exc:
            await self.close()
            raise from_gateway(exc, param=self.plan.structured_param) from None
        except BaseException:
            await self.close()
            raise

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        assert self._stream is not None, "start() first"
        stream = self._stream
        prompt: list[Token] = []
        pending: list[Token] = []
        echo_sent = self.plan.echo_text is None
        try:
            event: Event | None = self._first
            while event is not None:
                if isinstance(event, Done):
                    self.done = event
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
            if self.done.finish_reason is FinishReason.EOS and pending and pending[-1].id in self._stop_ids:
                pending.pop()  # the end-of-turn token (or stop id) is not part of the answer
            text = self.done.text or ""
            if text or pending:
                yield Piece(text, pending)
        finally:
            await self.close()

    async def close(self) -> None:
        """Release the stream (the core undoes an unfinished turn) and note the session's length."""
        stream, self._stream = self._stream, None
        with anyio.CancelScope(shield=True):  # runs even when the client left and the task is cancelled
            if stream is not None:
                with contextlib.suppress(Exception):
                    await stream.aclose()
            if self.plan.session_id is not None:
                with contextlib.suppress(GatewayError):
                    self.session_length = len(await self.service.session(self.plan.session_id))

    def _token(self, event: TokenEvent) -> Token:
        text, raw = self.texts.get(event.id)
        token = Token(event.id, event.position, text, raw)
        if self.plan.want_logprobs:
            token.logprob = None if event.logprob is None else _finite(event.logprob)
            if event.top_logprobs is not None:
                token.top = [(*self.texts.get(i), _finite(lp)) for i, lp in event.top_logprobs]
                token.top_ids = [i for i, _ in event.top_logprobs]
        if self.plan.axes is not None and event.readout is not None:
            token.readout = self.plan.axes.take(event.readout)
        if self.plan.features is not None:
            token.features = event.features
        return token


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR
