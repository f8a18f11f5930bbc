"""The process-wide engine pool: one place for admission control and priorities.

Every codec submits through the same pool, so limits hold across protocols: a
flood of GraphPipe rows cannot starve Salience sessions beyond their priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncGenerator, AsyncIterator

from prismgate.core import health
from prismgate.core.engine import Engine, EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Event
from prismgate.core.health import Health


class Admission:
    """At most ``max_active`` requests run; the rest wait, lowest priority value first."""

    def __init__(self, max_active: int, max_queued: int) -> None:
        if max_active < 1:
            raise ValueError("max_active must be >= 1")
        self.max_active = max_active
        self.max_queued = max_queued
        self.active = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def queued(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    @contextlib.asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        if self.active >= self.max_active or self._waiters:
            if self.queued >= self.max_queued:
                raise GatewayError(
                    Code.UNAVAILABLE,
                    f"server overloaded: {self.active} requests running and "
                    f"{self.queued} waiting (limit {self.max_queued}); retry later",
                )
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (priority, next(self._order), future))
            try:
                await future
            except BaseException:
                if future.done() and not future.cancelled():
                    self._release()  # we were granted the slot but are leaving
                raise
        else:
            self.active += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)  # the slot passes straight to the waiter
                return
        self.active -= 1


class EnginePool:
    """Engines by model id, shared by every codec in the process."""

    def __init__(self, engines: list[Engine], *, max_active: int = 64, max_queued: int = 1024) -> None:
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        self._engines = {e.model_id: e for e in engines}
        self.default_model = engines[0].model_id
        self.admission = Admission(max_active, max_queued)
        self._stopping = False

    @property
    def models(self) -> list[str]:
        return list(self._engines)

    def engine(self, model: str | None = None) -> Engine:
        name = model or self.default_model
        engine = self._engines.get(name)
        if engine is None:
            served = ", ".join(sorted(self._engines))
            raise GatewayError(Code.NOT_FOUND, f"model {name!r} is not served here; this server serves {served}")
        return engine

    def health(self) -> Health:
        """READY only when every engine is; otherwise the state that keeps the pool from serving."""
        if self._stopping:
            return health.STOPPING
        return health.worst([engine.health() for engine in self._engines.values()])

    @property
    def ready(self) -> bool:
        """``health().ready``, read-only; for callers that only need yes or no."""
        return self.health().ready

    def begin_stopping(self) -> None:
        """Report STOPPING from now on, before :meth:`close`: probes take this replica out while
        in-flight generations finish."""
        self._stopping = True

    async def start(self) -> None:
        for engine in self._engines.values():
            await engine.start()

    async def close(self) -> None:
        self._stopping = True
        for engine in self._engines.values():
            await engine.close()

    def release(self, session_key: str) -> None:
        for engine in self._engines.values():
            engine.release(session_key)

    async def generate(self, model: str | None, request: EngineRequest) -> AsyncGenerator[Event, None]:
        engine = self.engine(model)
        async with self.admission.slot(request.spec.priority):
            stream = engine.generate(request)
            try:
                async for event in stream:
                    yield event
            finally:
                await stream.aclose()
