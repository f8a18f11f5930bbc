"""The transformers engine: real hidden states, per-session KV reuse, one worker thread.

All model work runs on one worker thread so the event loop never blocks. Where each part
lives:

* :mod:`.loading`: weights, tokenizer and concept pack in, :class:`EngineInfo` out;
* :mod:`.bridge`: events from the worker thread to the consumer's loop, with backpressure;
* :mod:`.scheduler`: the worker thread, and which request steps next;
* :mod:`.steps`: one request advanced a prefill chunk or a decode token at a time;
* :mod:`.batched_decode`: the decode steps of several requests in one forward pass;
* :mod:`.kv_reuse`: each session's KV cache kept between turns, and what a turn can keep;
* :mod:`.adapters` and :mod:`.vision`: what differs between model families.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import torch

from prismgate.core import health
from prismgate.core.engine import EngineInfo, EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, Event
from prismgate.core.health import Health
from prismgate.engines.hf.adapters import ModelAdapter
from prismgate.engines.hf.bridge import EventChannel
from prismgate.engines.hf.grammar import Grammars
from prismgate.engines.hf.job import Job
from prismgate.engines.hf.kv_reuse import SessionCaches
from prismgate.engines.hf.loading import LoadedModel, load
from prismgate.engines.hf.scheduler import Scheduler
from prismgate.engines.hf.steps import Stepper
from prismgate.engines.sae.encode import SaeEncoder


class TransformersEngine:
    """An :class:`~prismgate.core.engine.Engine` on PyTorch + transformers."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_id: str | None = None,
        concept_pack: str | Path | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        threads: int | None = None,
        prefill_chunk: int = 512,
        step_target_ms: int = 200,
        max_cached_tokens: int = 1 << 18,
        max_cached_bytes: int = 0,
        max_batch: int = 16,
        max_batch_tokens: int = 16384,
        packed_weights: bool = True,
        huge_pages: bool = True,
        grammar_cache_bytes: int = 64 << 20,
        grammar_compile_timeout_s: float = 10.0,
        saes: tuple[tuple[Path, Path | None], ...] = (),
    ) -> None:
        self.model_path = Path(model_path)
        self.model_id = model_id or self.model_path.resolve().name
        self._pack_path = concept_pack
        self._sae_specs = saes  # (SAELens folder, labels file or None), loaded and checked at start
        self._device_name = device
        self._dtype_name = dtype
        self._max_model_len = max_model_len
        self._threads = threads
        self.prefill_chunk = prefill_chunk
        self.step_target_ms = step_target_ms  # while others wait, a round's prefill lasts about this long (0: no bound)
        self.max_batch = max_batch  # decode steps of this many requests run as one forward pass
        self.max_batch_tokens = max_batch_tokens  # ... while batch size x longest context stays under this
        self._packed_weights = packed_weights  # bf16 weights packed for oneDNN at load (engines.hf.packing)
        self._huge_pages = huge_pages  # the loaded weights moved into 2 MiB pages (engines.huge_pages)
        self._sessions = SessionCaches(max_cached_tokens, max_cached_bytes)
        self._grammar_cache_bytes = grammar_cache_bytes
        self._grammar_timeout_s = grammar_compile_timeout_s
        self._grammars: Grammars | None = None  # set by start()
        self._adapter: ModelAdapter | None = None
        self._scheduler: Scheduler | None = None
        self._jobs: dict[int, Job] = {}  # requests in flight, by id() of their EngineRequest (for hold)
        self._failure: str | None = None
        self._closing = False
        self.info: EngineInfo = None  # type: ignore[assignment]  # set by start()
        self.saes: tuple[SaeEncoder, ...] = ()  # set by start(): the loaded SAEs, by layer
        self.stats = {
            "prefilled_tokens": 0,
            "reused_tokens": 0,
            "decoded_tokens": 0,
            "batched_steps": 0,  # decode steps of several requests in one pass
            "ridden_steps": 0,  # decode steps that rode in a prompt chunk's pass (engines.hf.mixed_pass)
            "shared_prefills": 0,  # passes in which several prompts' chunks ran together (the same)
            "dropped_tokens": 0,  # keys and values dropped from requests preempted for memory ...
            "recomputed_tokens": 0,  # ... and recomputed before they went on
        }

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self._scheduler is not None:
            return
        try:
            loaded = await asyncio.to_thread(self._load)
        except Exception as exc:
            self._failure = f"{self.model_id} failed to load: {type(exc).__name__}: {exc}"
            raise
        self._failure = None
        self._adapter = loaded.adapter
        self.info = loaded.info
        self.saes = loaded.saes
        tokenizer = getattr(loaded.info.tokenizer, "hf", None)
        self._grammars = Grammars(
            tokenizer,
            loaded.info.vocab_size,
            loaded.info.eos_token_ids,
            cache_bytes=self._grammar_cache_bytes,
            timeout_s=self._grammar_timeout_s,
        )
        stepper = Stepper(
            loaded.adapter,
            loaded.probe,
            loaded.steerer,
            loaded.info.eos_token_ids,
            self._sessions,
            self.stats,
            prefill_chunk=self.prefill_chunk,
            features=loaded.features,
            rides=loaded.info.mixed_passes,
        )
        self._scheduler = Scheduler(
            stepper,
            max_batch=self.max_batch if loaded.adapter.batches_decode else 1,
            max_batch_tokens=self.max_batch_tokens,
            threads=self._threads,
            step_target_s=self.step_target_ms / 1000,
        )
        self._scheduler.start()

    def _load(self) -> LoadedModel:
        if self._threads:
            torch.set_num_threads(self._threads)
        return load(
            self.model_path,
            model_id=self.model_id,
            concept_pack=self._pack_path,
            device=self._device_name,
            dtype=self._dtype_name,
            max_model_len=self._max_model_len,
            saes=self._sae_specs,
            packed_weights=self._packed_weights,
            huge_pages=self._huge_pages,
        )

    async def close(self) -> None:
        self._closing = True
        if self._scheduler is not None:
            await self._scheduler.stop()
            self._scheduler = None
        if self._grammars is not None:
            self._grammars.close()

    def health(self) -> Health:
        if self._closing:
            return health.STOPPING
        if self._failure is not None:
            return health.failed(self._failure)
        if self._scheduler is None:
            return health.LOADING
        if self._scheduler.failure is not None:
            return health.failed(f"{self.model_id}: the worker thread failed: {self._scheduler.failure}")
        return health.READY

    # -- the Engine contract -----------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        scheduler = self._scheduler
        if scheduler is None:
            raise GatewayError(Code.UNAVAILABLE, "the engine is not started")
        job = Job(request, EventChannel(asyncio.get_running_loop()))
        if request.spec.structured is not None and self._grammars is not None:
            job.constraint = await self._grammars.compile(request.spec.structured)
        scheduler.submit(job)
        self._jobs[id(request)] = job
        try:
            while True:
                event = await job.channel.receive()
                yield event
                if isinstance(event, Done):
                    return
        finally:
            self._jobs.pop(id(request), None)
            scheduler.cancel(job)

    def hold(self, request: EngineRequest, held: bool, *, drop: bool = False) -> bool:
        """Preemption's mechanism (:class:`~prismgate.core.engine.Holdable`): hold ``request`` at its
        next step boundary, its KV cache kept (or dropped, to be recomputed when let go), or let it go
        on. Whether it is in flight here."""
        job = self._jobs.get(id(request))
        if job is None or self._scheduler is None:
            return False
        self._scheduler.hold(job, held, drop=drop)
        return True

    def image_tokens(self, data: bytes, mime: str) -> int:
        assert self._adapter is not None
        return self._adapter.image_tokens(data, mime)

    def in_flight(self) -> int:
        return 0 if self._scheduler is None else self._scheduler.in_flight()

    def release(self, session_key: str) -> None:
        if self._scheduler is not None:
            self._scheduler.release(session_key)
