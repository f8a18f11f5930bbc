"""What the gateway counts and logs: every generation as it passes the core, every refused request.

The core service hands each generation stream to :meth:`GenerationObserver.watch`, whatever
protocol sent it, so counting happens in one place and no codec has to remember to. The
observer never changes an event: it times and counts them, logs one line when the generation
ends, and enters it in the shutdown :class:`~prismgate.drain.Drain` while it runs. Requests
refused before any generation reach it through :meth:`GenerationObserver.refused`; an HTTP
request is counted at most once (:func:`request_tally`). Which labels a series carries, and
why a client's model name never becomes one: docs/operations.md, "Metrics".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

from prismgate.core.actions import GenerateAction
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, Event, TokenEvent
from prismgate.core.principal import current
from prismgate.core.service import SessionService
from prismgate.drain import Drain
from prismgate.keys import KeyRing
from prismgate.logs import context_field
from prismgate.metrics import NO_MODEL, GatewayMetrics
from prismgate.settings import Settings

log = logging.getLogger("prismgate.generation")

# Codes that mean "the client asked for something we will not do": logged at info, not as failures of ours.
_CLIENT_CODES = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.FAILED_PRECONDITION,
        Code.RESOURCE_EXHAUSTED,
        Code.ABORTED,
        Code.CANCELLED,
        Code.UNAUTHENTICATED,
        Code.PERMISSION_DENIED,
    }
)


# Refusals of a key's own rules: each logs one line naming the key.
_KEY_CODES = frozenset({Code.UNAUTHENTICATED, Code.PERMISSION_DENIED, Code.RESOURCE_EXHAUSTED})


@dataclass
class RequestTally:
    """Whether an error of the current request has been counted (set by whoever counts it)."""

    counted: bool = False


_TALLY: contextvars.ContextVar[RequestTally | None] = contextvars.ContextVar("prismgate_request_tally", default=None)


@contextlib.contextmanager
def request_tally() -> Iterator[RequestTally]:
    """Track, for the request handled inside the block (tasks it spawns included), whether it was counted."""
    tally = RequestTally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def _mark_counted() -> None:
    tally = _TALLY.get()
    if tally is not None:
        tally.counted = True


@dataclass
class _Generation:
    """Running tallies for one generation."""

    protocol: str
    session_id: str
    request_id: str
    start: float
    key: str = ""  # the key's name as a metric label: a configured name, or ""
    model: str | None = None  # the served model, once the core names it (then the request is counted)
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    readout_tokens: int = 0
    done: Done | None = None
    ended: bool = False
    output_ids: list[int] = field(default_factory=list)
    itl: Any = None  # this protocol and model's series, looked up once rather than per token
    streamed: Any = None


class GenerationObserver:
    """The core's ``GenerationMonitor`` for a gateway: metrics and one log line per generation."""

    def __init__(
        self, metrics: GatewayMetrics, settings: Settings, service: SessionService, drain: Drain, keys: KeyRing
    ) -> None:
        self.metrics = metrics
        self.settings = settings
        self.service = service
        self.drain = drain
        self.keys = keys
        self._running: dict[str, _Generation] = {}  # by the core's request id, until the model is named
        metrics.touch_keys(keys.names | {""})  # "": requests without a key (refused before one, or no keys)

    def _key(self) -> str:
        """The calling key's name as a label: only configured names (a bounded set), else ""."""
        name = current().name
        return name if name in self.keys.names else ""

    def refused(self, protocol: str, code: Code) -> None:
        """Count a request refused before it reached a generation (auth, parse, validation)."""
        self.metrics.errors.labels(protocol, code.name, NO_MODEL).inc()
        self.metrics.key_refusals.labels(self._key(), code.name).inc()
        _mark_counted()
        if code in _KEY_CODES and self.keys.enabled:  # who was refused, by name (never the key itself)
            log.info("request refused", extra={"protocol": protocol, "code": code.name, "key": current().name})

    def running(self, request_id: str, model: str) -> None:
        """The core names the generation's model: count the request under it."""
        g = self._running.pop(request_id, None)
        if g is not None:
            self._count(g, model if model in self.service.models.names else NO_MODEL)

    def _count(self, g: _Generation, model: str) -> None:
        g.model = model
        m = self.metrics
        m.requests.labels(g.protocol, model).inc()
        m.key_requests.labels(g.key).inc()
        g.itl, g.streamed = m.itl.labels(g.protocol, model), m.streamed_tokens.labels(g.protocol, model)

    async def watch(
        self, action: GenerateAction, session_id: str, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]:
        protocol = action.origin or "unknown"
        # logged and drained under the codec's own request id when it bound one; the core names the model by its own
        request_id_logged = context_field("request_id") or request_id
        g = _Generation(protocol, session_id, request_id_logged, time.perf_counter(), self._key())
        try:
            self.drain.enter(g.request_id)
        except GatewayError as exc:
            await events.aclose()
            self._count(g, NO_MODEL)
            self.refused(protocol, exc.code)
            raise
        self._running[request_id] = g
        self.metrics.active.labels(protocol).inc()
        error: GatewayError | None = None
        try:
            async for event in events:
                self._see(g, event)
                if isinstance(event, Done):
                    # Done is the last event: account now, not when the caller gets round to closing the stream
                    self._end(g, action, None)
                yield event
        except GatewayError as exc:
            error = exc
            raise
        except asyncio.CancelledError:
            cut = self.drain.cut_error()
            if cut is not None:
                # our own cancellation at the end of the grace period: the codec reports it as an error on its wire
                error = cut
                raise cut from None
            raise  # the client went away: a cancelled generation, not an error
        except GeneratorExit:
            raise  # the caller closed the stream early: cancelled, not an error
        except Exception as exc:
            error = GatewayError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._running.pop(request_id, None)
            self._end(g, action, error)
            await events.aclose()

    def _end(self, g: _Generation, action: GenerateAction, error: GatewayError | None) -> None:
        if g.ended:
            return
        g.ended = True
        self.metrics.active.labels(g.protocol).dec()
        self.drain.leave(g.request_id)
        self._finish(g, action, error)

    def _see(self, g: _Generation, event: Event) -> None:
        if isinstance(event, TokenEvent):
            if event.readout is not None:
                g.readout_tokens += 1
            if event.is_prefill:
                return
            now = time.perf_counter()
            if g.first_token is None:
                g.first_token = now
                self.metrics.ttft.labels(g.protocol, g.model).observe(now - g.start)
            elif g.last_token is not None:
                g.itl.observe(now - g.last_token)
            g.last_token = now
            g.completion_tokens += 1
            g.streamed.inc()
            if self.settings.observability.log_prompts:
                g.output_ids.append(event.id)
        else:
            g.done = event

    def _finish(self, g: _Generation, action: GenerateAction, error: GatewayError | None) -> None:
        m = self.metrics
        p = g.protocol
        model = g.model
        if model is None:  # ended before the core named its model: refused on its session or model
            model = NO_MODEL
            self._count(g, model)
        duration = time.perf_counter() - g.start
        m.duration.labels(p, model).observe(duration)
        m.readout_tokens.labels(p, model).inc(g.readout_tokens)
        fields: dict[str, object] = {"protocol": p, "session_id": g.session_id, "request_id": g.request_id}
        if model:
            fields["model"] = model
        if self.keys.enabled:
            fields["key"] = current().name
        if error is not None and g.done is None:
            m.errors.labels(p, error.code.name, model).inc()
            m.key_refusals.labels(g.key, error.code.name).inc()
            _mark_counted()
            fields.update(code=error.code.name, error=error.message, duration_s=round(duration, 4))
            level = logging.INFO if error.code in _CLIENT_CODES else logging.ERROR
            if error.code is Code.UNAVAILABLE:
                level = logging.WARNING  # overload or shutdown: ours, but not a fault
            log.log(level, "generation failed", extra=fields)
            return
        done = g.done
        reason = done.finish_reason.value if done is not None else "cancelled"
        m.finished.labels(p, reason, model).inc()
        if done is not None:
            m.prompt_tokens.labels(p, model).inc(done.prompt_tokens)
            m.cached_tokens.labels(p, model).inc(done.cached_tokens)
            m.prefilled_tokens.labels(p, model).inc(done.prefilled_tokens)
            m.key_tokens.labels(g.key, "prompt").inc(done.prompt_tokens)
        m.key_tokens.labels(g.key, "completion").inc(g.completion_tokens)
        fields.update(
            prompt_tokens=done.prompt_tokens if done is not None else None,
            completion_tokens=g.completion_tokens,
            cached_tokens=done.cached_tokens if done is not None else None,
            finish_reason=reason,
            ttft_s=round(g.first_token - g.start, 4) if g.first_token is not None else None,
            duration_s=round(duration, 4),
        )
        if self.settings.observability.log_prompts:
            fields.update(self._texts(action, g))
        log.info("generation finished", extra=fields)

    def _texts(self, action: GenerateAction, g: _Generation) -> dict[str, str]:
        """Prompt (this call's append) and output text, only when the setting log_prompts allows it."""
        try:
            decode = self.service.info(g.model or None).tokenizer.decode
            return {"prompt_text": decode(list(action.append_tokens)), "output_text": decode(g.output_ids)}
        except Exception:  # logging must never fail a request
            return {}
