"""The step machine: one request advanced by one step at a time.

A step is a prefill chunk of at most ``prefill_chunk`` prompt tokens (:data:`SCORED_CHUNK` while
the chunk scores prompt positions; fewer when the scheduler paces it, :mod:`~prismgate.engines.hf.pace`),
or one decode token.
Small steps let the scheduler interleave requests, so a long prompt cannot stall other
streams for its whole prefill. A decoded token whose readout was asked for is held until
the next step has run it through the model (its hidden state appears only then).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prismgate.core.actions import GenerateSpec, covered
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.events import Done, FinishReason, TokenEvent
from prismgate.core.steering import spans
from prismgate.engines.hf import kv_room, mixed_pass
from prismgate.engines.hf.adapters import ModelAdapter
from prismgate.engines.hf.batch_cache import BatchCaches
from prismgate.engines.hf.job import Job
from prismgate.engines.hf.kv_reuse import Forks, Kept, SessionCaches, resume
from prismgate.engines.hf.mixed_pass import Riders
from prismgate.engines.hf.sampling import History, logprobs_of, sample
from prismgate.engines.hf.steering import GateKey, RowPlan, Steerer
from prismgate.engines.invariant_rows import SWITCH
from prismgate.engines.readouts.probe import ReadoutProbe
from prismgate.engines.sae.probe import Captured, FeatureProbe

# Prompt tokens per step while a chunk scores prompt positions: each scored position needs a
# full-vocabulary row of logits (kept in the model's dtype and converted a row at a time),
# reduced to its top-k as soon as the chunk has run, so this bounds those rows however large an
# operator sets prefill_chunk. Not fewer: every chunk grows each layer's keys and values by a
# copy, and small chunks fragment the heap (figures in docs/benchmarks.md). The pace
# (:mod:`~prismgate.engines.hf.pace`) still goes down to 32-token chunks while others wait: the
# scheduler trims the heap after rounds that prefill, and the smallest chunks run only when a
# round's time allows no more.
SCORED_CHUNK = 512


@dataclass(frozen=True, slots=True)
class _Feed:
    """Positions ``[start, end)`` of a job's timeline about to run, and the logits their pass keeps:
    ``rows`` (indices into ``ids``; the last row when ``kept`` is false, which nothing reads), and
    whether the last predicts the next token (``needs_next``)."""

    job: Job
    start: int
    end: int
    ids: list[int]
    rows: list[int]
    kept: bool
    needs_next: bool


class Stepper:
    def __init__(
        self,
        adapter: ModelAdapter,
        probe: ReadoutProbe | None,
        steerer: Steerer | None,
        eos_token_ids: tuple[int, ...],
        caches: SessionCaches,
        stats: dict[str, int],
        *,
        prefill_chunk: int,
        features: FeatureProbe | None = None,
        rides: bool = False,
    ) -> None:
        self.adapter = adapter
        self.probe = probe
        self.steerer = steerer
        self.eos_token_ids = eos_token_ids
        self.caches = caches
        self.stats = stats
        self.prefill_chunk = prefill_chunk
        self.features = features
        self.rides = rides  # decode rows may ride in prompt chunks' passes (mixed_pass.check passed at load)
        self.batches = BatchCaches(adapter)  # the merged caches of the requests decoding together
        self.forks = Forks(caches)  # prefilled prompts waiting for their other generations

    def step(self, job: Job, chunk: int | None = None, riders: Riders | None = None) -> None:
        """Advance ``job`` one step; a prefill chunk runs at most ``chunk`` prompt tokens when given, and
        carries ``riders`` in its pass unless it steers or is deterministic
        (:mod:`~prismgate.engines.hf.mixed_pass`; their logits are then in ``riders.logits``)."""
        if not job.started:
            self.begin(job)
            if job.ended:
                return
        if job.refilling:
            self.refill(job, chunk)
            return
        if job.next_prefill < job.prompt_len:
            end = self.chunk_end(job, chunk)
            self.feed(job, job.next_prefill, end, riders)
            self._prompt_ran(job, end)
            return
        if job.generated == 0 and job.next_logits is not None:
            self.decode_one(job)  # a forked prefill: the first token comes from the kept logits
        elif job.finish is None:
            # feed the last decoded token: yields its readout and the next distribution
            position = len(job.timeline) - 1
            self.feed(job, position, position + 1)
            self.decode_one(job)
        self.finish_if_done(job)

    def chunk_end(self, job: Job, chunk: int | None) -> int:
        """Where ``job``'s next prefill chunk ends: at most ``chunk`` tokens when given, else
        ``prefill_chunk``; at most :data:`SCORED_CHUNK` where it scores prompt positions."""
        spec, start, n = job.request.spec, job.next_prefill, job.prompt_len
        size = self.prefill_chunk if chunk is None else max(1, min(chunk, self.prefill_chunk))
        if any(covered(spec.logprob_ranges, p) for p in range(start + 1, min(n, start + size) + 1)):
            size = min(size, SCORED_CHUNK)
        return self.adapter.chunk_end(job.request.images, start, min(n, start + size))

    def _prompt_ran(self, job: Job, end: int) -> None:
        """``job``'s prompt ran up to ``end``: once all of it has, the request ends (prefill only) or
        samples its first token."""
        job.next_prefill = end
        if end < job.prompt_len:
            return
        if job.request.spec.max_tokens == 0:
            self.end(job, FinishReason.PREFILL_ONLY)
            return
        self.decode_one(job)
        self.finish_if_done(job)

    def finish_if_done(self, job: Job) -> None:
        if job.finish is not None:
            if job.held is not None:  # the last token still needs its readout
                position = len(job.timeline) - 1
                self.feed(job, position, position + 1)
            self.end(job, job.finish)

    def end(self, job: Job, reason: FinishReason) -> None:
        """Send Done and keep the session's cache for its next turn."""
        job.ended = True
        self.batches.leave(job.cache)
        key = job.request.session_key
        if key is not None and job.cache is not None:
            self.caches.keep(
                key,
                job.cache,
                job.cached,
                spans(job.request.spec.steering, job.prompt_len, len(job.cached)),
                job.gates,
                job.invariant,
            )
        prefilled = len(job.timeline) - job.reused - job.generated if job.started else 0
        job.emit(
            Done(
                prompt_tokens=job.prompt_len,
                completion_tokens=job.generated,
                finish_reason=reason,
                cached_tokens=job.reused,
                prefilled_tokens=max(0, min(prefilled, job.prompt_len - job.reused)),
            )
        )

    def fail(self, job: Job, error: GatewayError) -> None:
        """End the request with ``error``; its cache is dropped, its contents may be half-written."""
        job.ended = True
        self.batches.drop(job.cache)
        job.cache = None
        job.cached = []
        job.emit(error)

    def drop(self, job: Job) -> None:
        """Free ``job``'s keys and values (preempted for memory): :meth:`refill` recomputes them before
        its next step. Everything else it holds (its timeline, a held event, its next logits) stays."""
        if not job.started or job.ended or not job.cached:
            return
        self.batches.drop(job.cache)
        job.refill = max(job.refill, len(job.cached))
        self.stats["dropped_tokens"] += len(job.cached)
        job.cache = None
        job.cached = []
        job.gates = {key: [] for key in job.gates}
        job.invariant = True

    def refill(self, job: Job, chunk: int | None = None) -> None:
        """Recompute a chunk of ``job``'s dropped keys and values, sending nothing: the passes its own
        steps ran (steered alike, through the batch-invariant kernels when it is deterministic), so a
        deterministic request's cache holds the same bits as before the drop."""
        start = len(job.cached)
        if job.cache is None:
            job.cache = self.adapter.new_cache()
            kv_room.expect(job.cache, len(job.timeline))
        size = self.prefill_chunk if chunk is None else max(1, min(chunk, self.prefill_chunk))
        end = self.adapter.chunk_end(job.request.images, start, min(job.refill, start + size))
        ids = job.timeline[start:end]
        if self.probe is not None:
            self.probe.enabled = False
        with self.steered([job.steer(0, start, end)]) as gates, SWITCH.on(job.deterministic):
            self.adapter.forward(ids, job.cache, start, job.timeline, job.request.images, [len(ids) - 1])
        job.invariant = job.invariant and job.deterministic
        job.record_gates(gates, 0, len(ids))
        job.cached.extend(ids)
        self.stats["recomputed_tokens"] += len(ids)

    def begin(self, job: Job) -> None:
        """Start ``job``: its session's kept cache found, its steering resolved; one done at once ends."""
        self._begin(job)
        if job.finish is not None:
            self.end(job, job.finish)

    def shares(self, job: Job) -> bool:
        """Whether ``job`` (begun) is at a prompt chunk that may share a pass with other prompts' chunks
        (:meth:`step_together`): prompt chunks share passes here, and it asks for nothing but logits of
        its prompt (no position scored, read out or encoded), neither steers nor is deterministic."""
        return (
            self.rides
            and job.started
            and not (job.ended or job.refilling or job.deterministic or job.steering or job.prompt_outputs)
            and job.next_prefill < job.prompt_len
        )

    def step_together(self, jobs: Sequence[Job], chunks: Sequence[int], riders: Riders | None = None) -> None:
        """Advance each of ``jobs`` (each :meth:`shares`) by a prefill chunk of at most its ``chunks`` tokens,
        all in one pass carrying ``riders`` (:mod:`~prismgate.engines.hf.mixed_pass`); one whose prompt
        is done samples its first token, as :meth:`step` would."""
        plans = []
        for job, chunk in zip(jobs, chunks, strict=True):
            self.batches.leave(job.cache)  # a prompt's chunk runs on its own cache
            plans.append(self._feed_plan(job, job.next_prefill, self.chunk_end(job, chunk)))
        if self.probe is not None:
            self.probe.enabled = False
        parts = [mixed_pass.Chunk(plan.ids, plan.job.cache, plan.start, plan.rows) for plan in plans]
        found = mixed_pass.forward(self.adapter, parts, riders)
        if riders is not None:
            self.batches.advance(riders.cache)
        self.stats["shared_prefills"] += 1
        for plan, logits in zip(plans, found, strict=True):
            plan.job.invariant = False
            self._settle(plan, logits, None, None)
            self._prompt_ran(plan.job, plan.end)

    def _begin(self, job: Job) -> None:
        job.started = True
        request = job.request
        spec = request.spec
        tokens = list(request.tokens)
        job.timeline = tokens
        job.generator = torch.Generator(device="cpu")
        job.generator.manual_seed(spec.seed if spec.seed is not None else int.from_bytes(np.random.bytes(7), "little"))
        if spec.steering:
            if self.steerer is None:
                raise invalid("steering needs a concept pack or an SAE, and this engine has neither loaded")
            job.steering = self.steerer.resolve(spec.steering)
        needed = {v.gate.key for v in job.steering if v.gate is not None}
        if request.session_key is None and request.fork is not None:
            kept = self.forks.take(request.fork)
        else:
            kept = self.caches.take(request.session_key)
        cache, start = resume(self.adapter, kept, tokens, request.images, spec, needed)
        kv_room.expect(cache, len(tokens))  # a buffer for the whole prompt when its first chunk runs
        job.gates = {key: kept.gates[key][:start] if start else [] for key in needed}
        job.cache = cache
        job.invariant = start == 0 or kept.invariant
        job.cached = tokens[:start]
        job.reused = start
        job.next_prefill = start
        if start == len(tokens) and kept.logits is not None:
            job.next_logits = kept.logits  # a forked prefill: sample from the leader's own row
        self.stats["reused_tokens"] += start
        if start >= len(tokens) and spec.max_tokens == 0:
            job.finish = FinishReason.PREFILL_ONLY

    def feed(self, job: Job, start: int, end: int, riders: Riders | None = None) -> None:
        """Run positions [start, end) of the timeline through the model, with ``riders`` in the same
        pass unless the request steers or is deterministic (see :meth:`step`)."""
        self.batches.leave(job.cache)  # a step of its own runs on its own cache
        spec = job.request.spec
        plan = self._feed_plan(job, start, end)
        want_readouts = self.probe is not None and any(covered(spec.readout_ranges, p) for p in range(start, end))
        if self.probe is not None:
            self.probe.enabled = want_readouts
        fspec = spec.features
        want_features = (
            self.features is not None
            and fspec is not None
            and any(covered(fspec.ranges, p) for p in range(start, end))
            and self.features.arm([fspec])
        )
        # a chunk that reads out or encodes features carries them too: the probes' products are
        # row by row (in fixed blocks), so its readouts and features keep their bits
        if riders is not None and self.rides and not (job.deterministic or job.steering):
            chunk = mixed_pass.Chunk(plan.ids, job.cache, start, plan.rows)
            (logits,) = mixed_pass.forward(self.adapter, [chunk], riders)
            self.batches.advance(riders.cache)
            gates: Mapping[GateKey, torch.Tensor] = {}
        else:
            with self.steered([job.steer(0, start, end)]) as gates, SWITCH.on(job.deterministic):
                logits = self.adapter.forward(plan.ids, job.cache, start, job.timeline, job.request.images, plan.rows)
        job.invariant = job.invariant and job.deterministic
        job.record_gates(gates, 0, len(plan.ids))
        readouts = self.probe.take() if want_readouts and self.probe is not None else None
        feats: Captured | None = self.features.take() if want_features and self.features is not None else None
        self._settle(plan, logits, readouts, feats)

    def _feed_plan(self, job: Job, start: int, end: int) -> _Feed:
        spec = job.request.spec
        n = job.prompt_len
        # Rows whose logits are needed: row r predicts position start + r + 1. Keep
        # the rows that score covered prompt positions (the one predicting `end` is
        # carried to the next feed), and the row to sample the next token from.
        scored = [p for p in range(max(start + 1, 1), min(end, n - 1) + 1) if covered(spec.logprob_ranges, p)]
        rows = [p - 1 - start for p in scored]
        needs_next = end >= n and spec.max_tokens > 0
        if needs_next:
            rows.append(end - 1 - start)
        ids = job.timeline[start:end]
        return _Feed(job, start, end, ids, rows or [len(ids) - 1], bool(rows), needs_next)

    def _settle(self, plan: _Feed, logits: torch.Tensor, readouts: np.ndarray | None, feats: Captured | None) -> None:
        """After ``plan``'s pass: its positions are cached; its prompt's events (logprobs, readouts,
        features), a held event and the logits it carries to the next step go out or are kept."""
        job, start, end, ids = plan.job, plan.start, plan.end, plan.ids
        spec = job.request.spec
        fspec = spec.features
        n = job.prompt_len
        rows = plan.rows if plan.kept else []
        needs_next = plan.needs_next
        job.cached.extend(ids)
        if end <= n:
            self.stats["prefilled_tokens"] += len(ids)
        fork = job.request.fork
        if fork is not None and fork.followers and start < n <= end and job.request.session_key is None:
            prompt_gates = {key: values[:n] for key, values in job.gates.items()}
            steered = spans(spec.steering, n, n)
            first_row = logits[-1].to(torch.float32) if needs_next else None  # what the first token is sampled from
            self.forks.keep(fork, Kept(job.cache, job.cached[:n], steered, prompt_gates, job.invariant, first_row))
        row_of = {r: logits[i] for i, r in enumerate(rows)} if rows else {}
        # prefill events, in position order
        for p in range(start, min(end, n)):
            lp_cov = covered(spec.logprob_ranges, p)
            ro_cov = readouts is not None and covered(spec.readout_ranges, p)
            fe_cov = feats is not None and fspec is not None and covered(fspec.ranges, p)
            if not (lp_cov or ro_cov or fe_cov):
                continue
            event = TokenEvent(id=job.timeline[p], position=p, is_prefill=True)
            if lp_cov and p > 0:
                prev = job.next_logits if p == start else row_of.get(p - 1 - start)
                if prev is None:
                    raise GatewayError(Code.INTERNAL, f"no logits kept for position {p}")
                event.logprob, event.top_logprobs = logprobs_of(prev.float(), event.id, spec.logprob_top_k)
            if ro_cov and readouts is not None:
                event.readout = readouts[p - start]
            if fe_cov and feats is not None and fspec is not None:
                event.features = feats.features(0, p - start, fspec)
            job.emit(event)
        # a held decode event gets its readout from this feed
        if job.held is not None and readouts is not None and start <= job.held.position < end:
            job.held.readout = readouts[job.held.position - start]
        held = job.held
        if held is not None and feats is not None and fspec is not None and start <= held.position < end:
            held.features = (
                feats.features(0, held.position - start, fspec) if covered(fspec.ranges, held.position) else None
            )
        if job.held is not None:
            job.emit(job.held)
            job.held = None
        # the kept row is a float32 copy: a view would keep this chunk's whole [rows, vocab] logits
        # alive until the next feed (a prefill chunk's rows are a full vocabulary each)
        if needs_next:
            job.next_logits = logits[-1].to(torch.float32, copy=True)
        elif end < n and covered(spec.logprob_ranges, end):
            job.next_logits = row_of[end - 1 - start].to(torch.float32, copy=True)
        else:
            job.next_logits = None

    def steered(self, rows: list[RowPlan]) -> contextlib.AbstractContextManager[Mapping[GateKey, torch.Tensor]]:
        """The next forward pass, steered row by row (a no-op when nothing is steered); it gives the gate readouts."""
        if self.steerer is None or not any(r.vectors for r in rows):
            return contextlib.nullcontext({})
        return self.steerer.plan(rows)

    def waits_for_hidden(self, spec: GenerateSpec, position: int) -> bool:
        """Whether a decoded token's event waits for the next pass: its readout or features come from it."""
        if self.probe is not None and covered(spec.readout_ranges, position):
            return True
        return self.features is not None and spec.features is not None and covered(spec.features.ranges, position)

    def decode_one(self, job: Job) -> None:
        """Sample the next token from ``job.next_logits``; decide whether the request is finished."""
        spec = job.request.spec
        assert job.next_logits is not None and job.generator is not None
        row = job.next_logits.to(device="cpu", dtype=torch.float32)  # the sampler's generator lives on the CPU
        if spec.shapes_logits and job.history is None:
            job.history = History(spec, job.timeline[: job.prompt_len], row.shape[-1], self.eos_token_ids)
        token = sample(row, spec, job.generator, job.history, job.constraint)
        if job.history is not None:
            job.history.add(token)
        if job.constraint is not None:
            job.constraint.accept(token)
        position = len(job.timeline)
        event = TokenEvent(id=token, position=position, is_prefill=False)
        if covered(spec.logprob_ranges, position):
            event.logprob, event.top_logprobs = logprobs_of(row, token, spec.logprob_top_k)
        job.timeline.append(token)
        job.generated += 1
        self.stats["decoded_tokens"] += 1
        if self.waits_for_hidden(spec, position):
            job.held = event
        else:
            job.emit(event)
        if spec.ends_on(token, job.generated, self.eos_token_ids) or (
            job.constraint is not None and job.constraint.done
        ):
            job.finish = FinishReason.EOS
        elif job.generated >= spec.max_tokens:
            job.finish = FinishReason.LENGTH
