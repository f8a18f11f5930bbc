"""An engine prepared before it serves: blocking steps composed in front of the serving engine's start.

The server binds its ports and logs them first; then :class:`PreparedEngine` runs each
:class:`Step` (converting the embedded model from GGUF, building a concept pack) on a worker
thread, with ``/readyz`` and gRPC health saying which step runs, and makes the serving engine
with the pack the steps settled on. Steps are given by the composition root: this module knows
no step's work, so the runtime composes the instruments' pack build without importing it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Protocol

from prismgate.core import health
from prismgate.core.engine import Engine, EngineInfo, EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Event
from prismgate.core.health import Health, HealthState

log = logging.getLogger("prismgate.readouts")  # one logger for what a start prepares for its readouts

Progress = Callable[[str], None]  # called from the step's thread with what it is doing now
EngineFactory = Callable[[Path | None], Engine]  # the serving engine, given the pack it loads (or none)


class Step(Protocol):
    """One preparation: blocking, run on a worker thread; given the pack so far, it returns the pack to load."""

    def reason(self, doing: str) -> str:
        """Health's reason while the step runs and last reported ``doing``."""
        ...

    def __call__(self, pack: Path | None, progress: Progress) -> Path | None: ...


class PreparedEngine:
    """:class:`~prismgate.core.engine.Engine` around ``make(pack)``, made once every step has run."""

    def __init__(self, make: EngineFactory, steps: Sequence[Step], *, model_id: str, pack: Path | None) -> None:
        self.model_id = model_id
        self._make = make
        self._steps = tuple(steps)
        self._pack = pack
        self._inner: Engine | None = None
        self._running: str | None = None  # health's reason while a step runs, swapped whole from its thread
        self._closing = False
        self.info: EngineInfo = None  # type: ignore[assignment]  # the wrapped engine's, once started

    async def start(self) -> None:
        if self._inner is not None:
            return
        pack = self._pack
        for step in self._steps:

            def progress(text: str, step: Step = step) -> None:
                self._running = step.reason(text)

            try:
                pack = await asyncio.to_thread(step, pack, progress)
            finally:
                self._running = None
            if self._closing:  # stopped while preparing: the model is never loaded
                return
        self._inner = self._make(pack)  # before start(): a model that fails to load reports FAILED
        await self._inner.start()
        self.info = self._inner.info

    def health(self) -> Health:
        if self._closing:
            return health.STOPPING
        if self._running is not None:
            return Health(HealthState.LOADING, self._running)
        if self._inner is None:
            return health.LOADING
        return self._inner.health()

    async def close(self) -> None:
        self._closing = True
        if self._inner is not None:
            await self._inner.close()

    def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        if self._inner is None:
            raise GatewayError(Code.UNAVAILABLE, "the engine is not started")
        return self._inner.generate(request)

    def image_tokens(self, data: bytes, mime: str) -> int:
        if self._inner is None:
            raise GatewayError(Code.UNAVAILABLE, "the engine is not started")
        return self._inner.image_tokens(data, mime)

    def release(self, session_key: str) -> None:
        if self._inner is not None:
            self._inner.release(session_key)

    def in_flight(self) -> int:
        return 0 if self._inner is None else self._inner.in_flight()


class ConvertStep:
    """The embedded default model's first start: its GGUF file converted to a model folder, once."""

    def __init__(self, convert: Callable[[], Path], *, model_id: str) -> None:
        self._convert = convert
        self._model_id = model_id

    def reason(self, doing: str) -> str:
        return "converting the default model from GGUF (once)"

    def __call__(self, pack: Path | None, progress: Progress) -> Path | None:
        progress("converting")
        started = time.perf_counter()
        folder = self._convert()
        log.info("converted %s to %s in %.1f s", self._model_id, folder, time.perf_counter() - started)
        return pack


class BuildSummary(Protocol):
    """What a pack build reports, for the log line that follows it."""

    @property
    def prompts(self) -> int: ...
    @property
    def layers(self) -> tuple[int, ...]: ...
    @property
    def load_s(self) -> float: ...
    @property
    def steer_s(self) -> float: ...


class PackStep:
    """``--concept-pack auto``: the pack at ``path`` reused, or built by ``build(path, progress)``.

    A build that fails is logged and the model serves without readouts: a pack is an extra,
    not a reason to refuse generation.
    """

    def __init__(
        self, build: Callable[[Path, Progress], BuildSummary], path: Path, *, model_id: str, pairs: int
    ) -> None:
        self._build = build
        self.path = path
        self._model_id = model_id
        self._pairs = pairs

    def reason(self, doing: str) -> str:
        return f"building concept pack: {doing}"

    def __call__(self, pack: Path | None, progress: Progress) -> Path | None:
        if self.path.exists():
            log.info("concept pack: reusing %s", self.path, extra={"pack": str(self.path)})
            return self.path
        log.info(
            "concept pack: building %s for %s from %d prompt pairs per concept",
            self.path,
            self._model_id,
            self._pairs,
            extra={"pack": str(self.path), "pairs": self._pairs},
        )
        progress("starting")

        def say(text: str) -> None:
            progress(text)
            log.info("concept pack: %s", text)

        started = time.perf_counter()
        try:
            stats = self._build(self.path, say)
        except Exception as exc:
            log.error(
                "concept pack: the build failed (%s: %s); serving %s without readouts",
                type(exc).__name__,
                exc,
                self._model_id,
            )
            return None
        seconds = time.perf_counter() - started
        log.info(
            "concept pack: built %s in %.1f s (model load %.1f s, %d prompts, steering measured in %.1f s); layers %s",
            self.path,
            seconds,
            stats.load_s,
            stats.prompts,
            stats.steer_s,
            ",".join(map(str, stats.layers)),
            extra={"pack": str(self.path), "build_s": round(seconds, 3), "prompts": stats.prompts},
        )
        return self.path
