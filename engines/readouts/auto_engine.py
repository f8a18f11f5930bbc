"""An engine that builds its model's concept pack (``--concept-pack auto``) before the model serves.

It wraps whichever engine serves the model: :meth:`AutoPackEngine.start` builds the pack on a
worker thread if the cache has none for this model (:mod:`.auto`), then starts the wrapped
engine with it. Until then its health is LOADING with the reason "building concept pack: ...",
so ``/readyz`` and gRPC health say what the replica is doing while the event loop keeps serving.
A build that fails is logged and the model serves without readouts: a pack is an extra, not a
reason to refuse generation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

from prismgate.core import health
from prismgate.core.engine import Engine, EngineInfo, EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Event
from prismgate.core.health import Health, HealthState
from prismgate.engines.readouts.auto import DEFAULT_PAIRS, build_auto_pack, check_pairs

log = logging.getLogger("prismgate.readouts")

EngineFactory = Callable[[Path | None], Engine]  # the serving engine, given the pack it loads (or none)


class AutoPackEngine:
    """:class:`~prismgate.core.engine.Engine` around ``make(pack)``, building the pack at ``pack_path`` first."""

    def __init__(
        self,
        make: EngineFactory,
        *,
        model_dir: str | Path,
        model_id: str,
        pack_path: Path,
        pairs: int = DEFAULT_PAIRS,
        dtype: str = "auto",
        device: str = "auto",
        threads: int = 1,
    ) -> None:
        check_pairs(pairs)  # a bad pair count is a settings error, found before anything loads
        self.model_id = model_id
        self.pack_path = pack_path
        self._make = make
        self._model_dir = Path(model_dir)
        self._pairs, self._dtype, self._device, self._threads = pairs, dtype, device, threads
        self._inner: Engine | None = None
        self._building: str | None = None  # what the build is doing now, while it runs
        self._preparing: str | None = None  # a step before the build (health's reason, whole), while it runs
        self._closing = False
        self.info: EngineInfo = None  # type: ignore[assignment]  # the wrapped engine's, once started

    async def start(self) -> None:
        if self._inner is not None:
            return
        pack: Path | None = self.pack_path
        if self.pack_path.exists():
            log.info("concept pack: reusing %s", self.pack_path, extra={"pack": str(self.pack_path)})
        else:
            pack = await self._build()
            if self._closing:  # stopped while building: the model is never loaded
                return
        self._inner = self._make(pack)  # before start(): a model that fails to load reports FAILED
        await self._inner.start()
        self.info = self._inner.info

    async def _build(self) -> Path | None:
        self._building = "starting"
        log.info(
            "concept pack: building %s for %s from %d prompt pairs per concept",
            self.pack_path,
            self.model_id,
            self._pairs,
            extra={"pack": str(self.pack_path), "pairs": self._pairs},
        )
        loop = asyncio.get_running_loop()

        def progress(text: str) -> None:  # on the build thread: the state is one string, swapped whole
            self._building = text
            loop.call_soon_threadsafe(lambda: log.info("concept pack: %s", text))

        started = time.perf_counter()
        try:
            stats = await asyncio.to_thread(
                build_auto_pack,
                self._model_dir,
                self.pack_path,
                model_id=self.model_id,
                pairs=self._pairs,
                dtype=self._dtype,
                device=self._device,
                threads=self._threads,
                progress=progress,
            )
        except Exception as exc:
            log.error(
                "concept pack: the build failed (%s: %s); serving %s without readouts",
                type(exc).__name__,
                exc,
                self.model_id,
            )
            return None
        finally:
            self._building = None
        seconds = time.perf_counter() - started
        log.info(
            "concept pack: built %s in %.1f s (model load %.1f s, %d prompts, steering measured in %.1f s); layers %s",
            self.pack_path,
            seconds,
            stats.load_s,
            stats.prompts,
            stats.steer_s,
            ",".join(map(str, stats.layers)),
            extra={"pack": str(self.pack_path), "build_s": round(seconds, 3), "prompts": stats.prompts},
        )
        return self.pack_path

    def health(self) -> Health:
        if self._closing:
            return health.STOPPING
        if self._preparing is not None:
            return Health(HealthState.LOADING, self._preparing)
        if self._building is not None:
            return Health(HealthState.LOADING, f"building concept pack: {self._building}")
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


class ConvertingEngine(AutoPackEngine):
    """The embedded default model on its first start: converted from GGUF (15-30 s, once) in :meth:`start`.

    So the conversion runs after the ports are bound and logged, like any model load, with
    ``/readyz`` answering "converting the default model from GGUF (once)" meanwhile; then the
    serving engine is made with ``pack`` (the shipped pack, or none) and started.
    """

    def __init__(self, make: EngineFactory, convert: Callable[[], Path], *, model_id: str, pack: Path | None) -> None:
        super().__init__(make, model_dir=".", model_id=model_id, pack_path=pack or Path())
        self._convert = convert
        self._pack = pack

    async def start(self) -> None:
        if self._inner is not None:
            return
        self._preparing = "converting the default model from GGUF (once)"
        started = time.perf_counter()
        try:
            folder = await asyncio.to_thread(self._convert)
        finally:
            self._preparing = None
        log.info("converted %s to %s in %.1f s", self.model_id, folder, time.perf_counter() - started)
        if self._closing:
            return
        self._inner = self._make(self._pack)
        await self._inner.start()
        self.info = self._inner.info
