"""The transformers engine: real hidden states, per-session KV reuse, one worker thread.

All model work runs on one worker thread so the event loop never blocks. The worker
interleaves active requests a step at a time (a prefill chunk or one decode token),
best priority first, so a long prompt cannot stall other streams for its whole
prefill. Each session's KV cache is kept between turns: a turn that shares a prefix
with the cached tokens only runs its new tokens through the model.

Positions a client asks logprobs or readouts for are recomputed if they lie in the
reused prefix (the cache keeps keys and values, not logits or hidden states), so a
reused prefix never yields a missing or stale value.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prismgate.core.actions import covered, first_covered
from prismgate.core.engine import EngineInfo, EngineRequest, ReadoutManifest
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.engines.hf.adapters import ModelAdapter, load_adapter
from prismgate.engines.hf.sampling import logprobs_of, sample
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.readouts.probe import ReadoutProbe
from prismgate.engines.tokenizer import HFTokenizer

log = logging.getLogger(__name__)

MAX_BACKLOG = 64  # events a slow consumer may leave unread before its request is paused


@dataclass(eq=False)
class _Job:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event | BaseException]
    order: int
    cancelled: bool = False
    produced: int = 0
    consumed: int = 0
    # model state, owned by the worker thread
    started: bool = False
    cache: Any = None
    cached: list[int] = field(default_factory=list)  # token ids whose keys/values are in `cache`
    timeline: list[int] = field(default_factory=list)  # prompt, then generated tokens
    reused: int = 0
    next_prefill: int = 0
    next_logits: torch.Tensor | None = None  # predicts position len(cached)
    held: TokenEvent | None = None  # a decoded token waiting for its readout
    generated: int = 0
    finish: FinishReason | None = None
    generator: torch.Generator | None = None
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def backlog(self) -> int:
        return self.produced - self.consumed

    @property
    def prompt_len(self) -> int:
        return len(self.request.tokens)


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
        max_cached_tokens: int = 1 << 18,
        max_batch: int = 16,
        max_batch_tokens: int = 16384,
    ) -> None:
        self.model_path = Path(model_path)
        self.model_id = model_id or self.model_path.resolve().name
        self._pack_path = concept_pack
        self._device_name = device
        self._dtype_name = dtype
        self._max_model_len = max_model_len
        self._threads = threads
        self.prefill_chunk = prefill_chunk
        self.max_cached_tokens = max_cached_tokens
        self.max_batch = max_batch  # decode steps of this many requests run as one forward pass
        self.max_batch_tokens = max_batch_tokens  # ... while batch size x longest context stays under this
        self._adapter: ModelAdapter | None = None
        self._probe: ReadoutProbe | None = None
        self._sessions: OrderedDict[str, tuple[Any, list[int]]] = OrderedDict()
        self._cv = threading.Condition()
        self._inbox: list[_Job] = []
        self._active: list[_Job] = []
        self._released: list[str] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.info: EngineInfo = None  # type: ignore[assignment]  # set by start()
        self.stats = {"prefilled_tokens": 0, "reused_tokens": 0, "decoded_tokens": 0, "batched_steps": 0}

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._worker, name="prismgate-transformers", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        device = self._device_name
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._adapter = load_adapter(self.model_path, device=device, dtype=self._dtype_name)
        model = self._adapter.model
        manifest: ReadoutManifest | None = None
        if self._pack_path is not None:
            pack = ConceptPack.load(self._pack_path)
            self._probe = ReadoutProbe(model, pack)
            manifest = pack.manifest
        tokenizer = self._adapter.tokenizer
        config = model.config.get_text_config()
        limit = self._max_model_len or int(getattr(config, "max_position_embeddings", 4096))
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        if not eos_ids and tokenizer.eos_token_id is not None:
            eos_ids = (int(tokenizer.eos_token_id),)
        self.info = EngineInfo(
            model_id=self.model_id,
            max_model_len=limit,
            vocab_size=int(config.vocab_size),
            eos_token_ids=eos_ids,
            tokenizer=HFTokenizer(tokenizer),
            readouts=manifest,
            vision=self._adapter.vision_tokens,
            engine_name="transformers",
        )
        log.info("loaded %s on %s (%s)", self.model_id, device, model.dtype)

    async def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # -- the Engine contract -----------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        if self._thread is None:
            raise GatewayError(Code.UNAVAILABLE, "the engine is not started")
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue(), next(self._order))
        with self._cv:
            if self._stopping:
                raise GatewayError(Code.UNAVAILABLE, "the engine is shutting down")
            self._inbox.append(job)
            self._cv.notify()
        try:
            while True:
                item = await job.queue.get()
                job.consumed += 1
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Done):
                    return
        finally:
            if not job.cancelled:
                with self._cv:
                    job.cancelled = True
                    self._cv.notify()

    def image_tokens(self, data: bytes, mime: str) -> int:
        assert self._adapter is not None
        return self._adapter.image_tokens(data, mime)

    def in_flight(self) -> int:
        with self._cv:
            return len(self._active) + len(self._inbox)

    def release(self, session_key: str) -> None:
        with self._cv:
            self._released.append(session_key)
            self._cv.notify()

    # -- the worker thread -------------------------------------------------------------

    def _worker(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        while True:
            with self._cv:
                while not (self._inbox or self._released or self._stopping) and not any(
                    j.cancelled or j.backlog < MAX_BACKLOG for j in self._active
                ):
                    self._cv.wait(timeout=0.05 if self._active else None)
                if self._stopping:
                    break
                self._active.extend(self._inbox)
                self._inbox.clear()
                released, self._released = self._released, []
            for key in released:
                self._sessions.pop(key, None)
            self._active.sort(key=lambda j: (j.request.spec.priority, j.order))
            batch = self._decode_batch_members()
            if batch:
                self._guarded(batch, self._decode_batch)
            for job in list(self._active):
                if job in batch:
                    continue
                if job.cancelled:
                    self._end(job, FinishReason.CANCELLED)
                elif job.backlog < MAX_BACKLOG:
                    self._guarded([job], lambda jobs: self._step(jobs[0]))
        with self._cv:
            leftover = self._active + self._inbox
            self._active, self._inbox = [], []
        for job in leftover:
            self._emit(job, Done(job.prompt_len, job.generated, FinishReason.CANCELLED))

    def _guarded(self, jobs: list[_Job], work: Any) -> None:
        """Run model work for ``jobs``; a failure fails those requests, never the worker."""
        try:
            with torch.inference_mode():
                work(jobs)
        except Exception as exc:  # the model failed: report it, keep serving
            error = exc if isinstance(exc, GatewayError) else None
            if error is None:
                log.exception("requests %s failed", [j.request.request_id for j in jobs])
                error = GatewayError(Code.INTERNAL, f"engine error: {type(exc).__name__}: {exc}")
            for job in jobs:
                if job in self._active:
                    self._fail(job, error)

    def _emit(self, job: _Job, item: Event | BaseException) -> None:
        job.produced += 1
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is gone
            job.cancelled = True

    def _fail(self, job: _Job, exc: GatewayError) -> None:
        job.cache = None  # its contents may be half-written
        job.cached = []
        self._active.remove(job)
        self._emit(job, exc)

    def _end(self, job: _Job, reason: FinishReason) -> None:
        self._active.remove(job)
        key = job.request.session_key
        if key is not None and job.cache is not None:
            self._store_cache(key, job.cache, job.cached)
        prefilled = len(job.timeline) - job.reused - job.generated if job.started else 0
        self._emit(
            job,
            Done(
                prompt_tokens=job.prompt_len,
                completion_tokens=job.generated,
                finish_reason=reason,
                cached_tokens=job.reused,
                prefilled_tokens=max(0, min(prefilled, job.prompt_len - job.reused)),
                timings={"total_s": time.perf_counter() - job.t_start},
            ),
        )

    def _store_cache(self, key: str, cache: Any, tokens: list[int]) -> None:
        self._sessions[key] = (cache, tokens)
        self._sessions.move_to_end(key)
        total = sum(len(t) for _, t in self._sessions.values())
        while total > self.max_cached_tokens and len(self._sessions) > 1:
            _, (_, dropped) = self._sessions.popitem(last=False)
            total -= len(dropped)

    # -- one step of one request -----------------------------------------------------------

    def _step(self, job: _Job) -> None:
        if not job.started:
            self._begin(job)
            if job.finish is not None:
                self._end(job, job.finish)
                return
        spec = job.request.spec
        n = job.prompt_len
        if job.next_prefill < n:
            end = self._adapter_chunk_end(job, job.next_prefill, min(n, job.next_prefill + self.prefill_chunk))
            self._feed(job, job.next_prefill, end)
            job.next_prefill = end
            if end < n:
                return
            if spec.max_tokens == 0:
                self._end(job, FinishReason.PREFILL_ONLY)
                return
            self._decode_one(job)
        elif job.finish is None:
            # feed the last decoded token: yields its readout and the next distribution
            position = len(job.timeline) - 1
            self._feed(job, position, position + 1)
            self._decode_one(job)
        self._finish_if_done(job)

    def _finish_if_done(self, job: _Job) -> None:
        if job.finish is not None:
            if job.held is not None:  # the last token still needs its readout
                position = len(job.timeline) - 1
                self._feed(job, position, position + 1)
            self._end(job, job.finish)

    # -- decode steps of several requests in one forward pass ---------------------------

    def _decode_batch_members(self) -> list[_Job]:
        """Requests whose next step is a plain decode step, as many as fit in one batch."""
        assert self._adapter is not None
        if not self._adapter.batches_decode or self.max_batch < 2:
            return []
        members: list[_Job] = []
        width = 0
        for job in self._active:
            if not (
                job.started
                and not job.cancelled
                and job.finish is None
                and job.backlog < MAX_BACKLOG
                and job.next_prefill >= job.prompt_len
                and len(job.timeline) > job.prompt_len
            ):
                continue
            position = len(job.timeline) - 1
            if max(width, position) * (len(members) + 1) > self.max_batch_tokens:
                continue  # padding every cache to the longest would copy too much
            members.append(job)
            width = max(width, position)
            if len(members) == self.max_batch:
                break
        return members if len(members) >= 2 else []

    def _decode_batch(self, jobs: list[_Job]) -> None:
        assert self._adapter is not None
        positions = [len(job.timeline) - 1 for job in jobs]
        wants = [
            self._probe is not None and covered(job.request.spec.readout_ranges, p)
            for job, p in zip(jobs, positions, strict=True)
        ]
        if self._probe is not None:
            self._probe.enabled = any(wants)
        logits = self._adapter.decode_batch(
            [job.timeline[p] for job, p in zip(jobs, positions, strict=True)], [job.cache for job in jobs], positions
        )
        readouts = self._probe.take_batch() if self._probe is not None and any(wants) else None
        self.stats["batched_steps"] += 1
        for row, (job, position) in enumerate(zip(jobs, positions, strict=True)):
            job.cached.append(job.timeline[position])
            if job.held is not None:
                if readouts is not None and wants[row]:
                    job.held.readout = readouts[row, 0]
                self._emit(job, job.held)
                job.held = None
            job.next_logits = logits[row]
            self._decode_one(job)
            self._finish_if_done(job)

    def _begin(self, job: _Job) -> None:
        job.started = True
        req = job.request
        spec = req.spec
        tokens = list(req.tokens)
        n = len(tokens)
        job.timeline = tokens
        job.generator = torch.Generator(device="cpu")
        job.generator.manual_seed(spec.seed if spec.seed is not None else int.from_bytes(np.random.bytes(7), "little"))
        cache: Any = None
        cached: list[int] = []
        if req.session_key is not None and req.session_key in self._sessions:
            cache, cached = self._sessions.pop(req.session_key)
        shared = 0
        for a, b in zip(cached, tokens, strict=False):
            if a != b:
                break
            shared += 1
        start = shared
        if spec.max_tokens > 0:
            start = min(start, n - 1)  # the last prompt token's logits are needed to sample
        first_lp = first_covered(spec.logprob_ranges)
        if first_lp is not None and first_lp < n:
            start = min(start, max(first_lp - 1, 0))
        first_ro = first_covered(spec.readout_ranges)
        if first_ro is not None and first_ro < n:
            start = min(start, first_ro)
        assert self._adapter is not None
        start = self._adapter.rewind_point(tokens, req.images, start, cache)
        if cache is None or start == 0:
            cache = self._adapter.new_cache()
        elif start < len(cached):
            cache.crop(start - len(cached))  # a negative count: tokens to drop from the end
        job.cache = cache
        job.cached = tokens[:start]
        job.reused = start
        job.next_prefill = start
        self.stats["reused_tokens"] += start
        if start >= n and spec.max_tokens == 0:
            job.finish = FinishReason.PREFILL_ONLY

    def _adapter_chunk_end(self, job: _Job, start: int, end: int) -> int:
        assert self._adapter is not None
        return self._adapter.chunk_end(job.request.images, start, end)

    def _feed(self, job: _Job, start: int, end: int) -> None:
        """Run positions [start, end) of the timeline through the model."""
        assert self._adapter is not None
        spec = job.request.spec
        n = job.prompt_len
        ids = job.timeline[start:end]
        # Rows whose logits are needed: row r predicts position start + r + 1. Keep
        # the rows that score covered prompt positions (the one predicting `end` is
        # carried to the next feed), and the row to sample the next token from.
        scored = [p for p in range(max(start + 1, 1), min(end, n - 1) + 1) if covered(spec.logprob_ranges, p)]
        rows = [p - 1 - start for p in scored]
        needs_next = end >= n and spec.max_tokens > 0
        if needs_next:
            rows.append(end - 1 - start)
        want_readouts = self._probe is not None and any(covered(spec.readout_ranges, p) for p in range(start, end))
        if self._probe is not None:
            self._probe.enabled = want_readouts
        logits = self._adapter.forward(ids, job.cache, start, job.timeline, job.request.images, rows or [len(ids) - 1])
        readouts = self._probe.take() if want_readouts and self._probe is not None else None
        job.cached.extend(ids)
        if end <= n:
            self.stats["prefilled_tokens"] += len(ids)
        row_of = {r: logits[i] for i, r in enumerate(rows)} if rows else {}
        # prefill events, in position order
        for p in range(start, min(end, n)):
            lp_cov = covered(spec.logprob_ranges, p)
            ro_cov = readouts is not None and covered(spec.readout_ranges, p)
            if not (lp_cov or ro_cov):
                continue
            event = TokenEvent(id=job.timeline[p], position=p, is_prefill=True)
            if lp_cov and p > 0:
                prev = job.next_logits if p == start else row_of.get(p - 1 - start)
                if prev is None:
                    raise GatewayError(Code.INTERNAL, f"no logits kept for position {p}")
                event.logprob, event.top_logprobs = logprobs_of(prev, event.id, spec.logprob_top_k)
            if ro_cov and readouts is not None:
                event.readout = readouts[p - start]
            self._emit(job, event)
        # a held decode event gets its readout from this feed
        if job.held is not None and readouts is not None and start <= job.held.position < end:
            job.held.readout = readouts[job.held.position - start]
        if job.held is not None:
            self._emit(job, job.held)
            job.held = None
        if needs_next:
            job.next_logits = logits[-1]
        elif end < n and covered(spec.logprob_ranges, end):
            job.next_logits = row_of[end - 1 - start]
        else:
            job.next_logits = None

    def _decode_one(self, job: _Job) -> None:
        spec = job.request.spec
        assert job.next_logits is not None and job.generator is not None
        row = job.next_logits.to(device="cpu", dtype=torch.float32)  # the sampler's generator lives on the CPU
        token = sample(row, spec, job.generator)
        position = len(job.timeline)
        event = TokenEvent(id=token, position=position, is_prefill=False)
        if covered(spec.logprob_ranges, position):
            event.logprob, event.top_logprobs = logprobs_of(row, token, spec.logprob_top_k)
        job.timeline.append(token)
        job.generated += 1
        self.stats["decoded_tokens"] += 1
        if self._probe is not None and covered(spec.readout_ranges, position):
            job.held = event
        else:
            self._emit(job, event)
        assert self.info is not None
        if token in spec.stop_token_ids or (not spec.ignore_eos and token in self.info.eos_token_ids):
            job.finish = FinishReason.EOS
        elif job.generated >= spec.max_tokens:
            job.finish = FinishReason.LENGTH


def check_threads(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise invalid(f"threads must be >= 1, got {value}")
    return value
