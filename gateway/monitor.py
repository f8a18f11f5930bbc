"""What the gateway watches on every generation: metrics, one log line, the shutdown drain.

The core service hands each generation stream to :meth:`GatewayMonitor.watch`
(``SessionService.monitor``), whatever protocol sent it, so counting happens in one
place and no codec has to remember to. The monitor never changes an event; it
times them, counts them, logs one line when the generation ends, and keeps the set
of generations in flight so that shutdown can wait for them (and refuse new ones).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from prismgate.core.actions import GenerateAction
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, Event, TokenEvent
from prismgate.core.service import SessionService
from prismgate.logs import context_field
from prismgate.metrics import GatewayMetrics
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
    }
)


@dataclass
class _Generation:
    """Running tallies for one generation."""

    protocol: str
    session_id: str
    request_id: str
    start: float
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    readout_tokens: int = 0
    done: Done | None = None
    ended: bool = False
    output_ids: list[int] = field(default_factory=list)
    itl: Any = None  # this protocol's series, looked up once rather than per token
    streamed: Any = None


class GatewayMonitor:
    def __init__(self, metrics: GatewayMetrics, settings: Settings, service: SessionService) -> None:
        self.metrics = metrics
        self.settings = settings
        self.service = service
        self.draining = False
        self._in_flight: dict[str, asyncio.Task[object] | None] = {}
        self._cut: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the hook the service calls ---------------------------------------------------

    def watch(
        self, action: GenerateAction, session_id: str, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]:
        return self._watch(action, session_id, context_field("request_id") or request_id, events)

    async def _watch(
        self, action: GenerateAction, session_id: str, request_id: str, events: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[Event, None]:
        protocol = action.origin or "unknown"
        m = self.metrics
        m.requests.labels(protocol).inc()
        if self.draining:
            await events.aclose()
            m.errors.labels(protocol, Code.UNAVAILABLE.name).inc()
            raise GatewayError(Code.UNAVAILABLE, "the server is shutting down; retry on another replica")
        g = _Generation(protocol, session_id, request_id, time.perf_counter())
        g.itl, g.streamed = m.itl.labels(protocol), m.streamed_tokens.labels(protocol)
        self._in_flight[request_id] = asyncio.current_task()
        self._idle.clear()
        m.active.labels(protocol).inc()
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
            task = asyncio.current_task()
            ours = task is not None and task in self._cut
            self._cut.discard(task)
            if ours and task is not None and task.uncancel() == 0:
                # our own cancellation at the end of the grace period: the codec reports it as an error on its wire
                error = GatewayError(
                    Code.UNAVAILABLE,
                    f"the server shut down before this generation finished (grace period "
                    f"{self.settings.shutdown_grace_s:g}s); retry on another replica",
                )
                raise error from None
            raise  # the client went away: a cancelled generation, not an error
        except GeneratorExit:
            raise  # the caller closed the stream early: cancelled, not an error
        except Exception as exc:
            error = GatewayError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._end(g, action, error)
            await events.aclose()

    def _end(self, g: _Generation, action: GenerateAction, error: GatewayError | None) -> None:
        if g.ended:
            return
        g.ended = True
        self.metrics.active.labels(g.protocol).dec()
        self._in_flight.pop(g.request_id, None)
        if not self._in_flight:
            self._idle.set()
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
                self.metrics.ttft.labels(g.protocol).observe(now - g.start)
            elif g.last_token is not None:
                g.itl.observe(now - g.last_token)
            g.last_token = now
            g.completion_tokens += 1
            g.streamed.inc()
            if self.settings.log_prompts:
                g.output_ids.append(event.id)
        else:
            g.done = event

    def _finish(self, g: _Generation, action: GenerateAction, error: GatewayError | None) -> None:
        m = self.metrics
        p = g.protocol
        duration = time.perf_counter() - g.start
        m.duration.labels(p).observe(duration)
        m.readout_tokens.labels(p).inc(g.readout_tokens)
        fields: dict[str, object] = {"protocol": p, "session_id": g.session_id, "request_id": g.request_id}
        if error is not None and g.done is None:
            m.errors.labels(p, error.code.name).inc()
            fields.update(code=error.code.name, error=error.message, duration_s=round(duration, 4))
            level = logging.INFO if error.code in _CLIENT_CODES else logging.ERROR
            if error.code is Code.UNAVAILABLE:
                level = logging.WARNING  # overload or shutdown: ours, but not a fault
            log.log(level, "generation failed", extra=fields)
            return
        done = g.done
        reason = done.finish_reason.value if done is not None else "cancelled"
        m.finished.labels(p, reason).inc()
        if done is not None:
            m.prompt_tokens.labels(p).inc(done.prompt_tokens)
            m.cached_tokens.labels(p).inc(done.cached_tokens)
            m.prefilled_tokens.labels(p).inc(done.prefilled_tokens)
        fields.update(
            prompt_tokens=done.prompt_tokens if done is not None else None,
            completion_tokens=g.completion_tokens,
            cached_tokens=done.cached_tokens if done is not None else None,
            finish_reason=reason,
            ttft_s=round(g.first_token - g.start, 4) if g.first_token is not None else None,
            duration_s=round(duration, 4),
        )
        if self.settings.log_prompts:
            fields.update(self._texts(action, g))
        log.info("generation finished", extra=fields)

    def _texts(self, action: GenerateAction, g: _Generation) -> dict[str, str]:
        """Prompt (this call's append) and output text, only when settings.log_prompts allows it."""
        try:
            decode = self.service.info().tokenizer.decode
            return {"prompt_text": decode(list(action.append_tokens)), "output_text": decode(g.output_ids)}
        except Exception:  # logging must never fail a request
            return {}

    # -- shutdown -----------------------------------------------------------------------

    def refused(self, protocol: str, code: Code) -> None:
        """Count a request refused before it reached a generation (auth, parse, validation)."""
        self.metrics.errors.labels(protocol, code.name).inc()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def start_draining(self) -> None:
        """From now on new generations fail UNAVAILABLE; running ones go on."""
        self.draining = True

    async def wait_idle(self, seconds: float, abort: asyncio.Event | None = None) -> bool:
        """Wait until no generation is in flight (True), ``seconds`` pass or ``abort`` is set (False)."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if abort is not None:
            waits.append(asyncio.ensure_future(abort.wait()))
        try:
            await asyncio.wait(waits, timeout=max(0.0, seconds), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()

    def cut_off(self) -> int:
        """The grace period is over: end every generation still running with UNAVAILABLE.

        The consuming tasks are cancelled, and the monitor turns that cancellation into
        a GatewayError where the generation is waiting on the engine, so each codec
        tells its client on its own wire (HTTP 503, an SSE error, a gRPC status, an
        Evergreen abort) instead of the connection just dropping.
        """
        tasks = {t for t in self._in_flight.values() if t is not None and not t.done()}
        for task in tasks:
            self._cut.add(task)
            task.cancel("the gateway is shutting down")
        return len(tasks)
