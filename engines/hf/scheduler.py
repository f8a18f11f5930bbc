"""Scheduling: which request the worker thread steps next, on the one thread that runs the model.

Requests are stepped best priority first, then first come, one step each per round (one more for
a newcomer: its first decode step), so streams interleave. Within a round, those with no token
yet step first, a newcomer's first step ahead of the other prompts' chunks (newcomers by priority,
then by the fair share's rank), so that its first token waits for nobody else's next one; then the
decode steps, which a newcomer given its first token joins at once. A newcomer that arrives during
a round cuts in at its next pass, once a round, rather than wait for the round's end. Prompts
still prefilling take the round's prefill in turns, sized so that the round lasts about a target
time while others wait (:mod:`~prismgate.engines.hf.pace`); newcomers' prompts that end in the
round's chunks and ask for nothing but logits share one pass (of one priority; a key with nothing
else running shares with no other key, nor carries their decode steps).
Those whose next step is a plain decode step go together in batched forward passes of up to
``max_batch`` requests each (:mod:`~prismgate.engines.hf.batched_decode`), the first of which may ride
in the round's first prompt chunk's pass (:mod:`~prismgate.engines.hf.mixed_pass`; a newcomer then
joins them next round); the rest take their own step (:mod:`~prismgate.engines.hf.steps`).
A request whose consumer is slow is skipped until it catches up
(:mod:`~prismgate.engines.hf.bridge`), and so is one the core holds (preempted: its KV cache
stays, it goes on from the same step when let go; or, when the core needs its memory, its cache
is dropped and recomputed in the rounds' prefill before it goes on); a cancelled one ends at its
next turn. A failing step fails only the requests it was for: the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
from collections.abc import Callable

import torch

from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, FinishReason
from prismgate.engines.hf.batched_decode import batch_groups, decode_batch, riders, riding_members
from prismgate.engines.hf.job import Job
from prismgate.engines.hf.mixed_pass import Riders
from prismgate.engines.hf.pace import Pace, Prefill
from prismgate.engines.hf.steps import Stepper
from prismgate.engines.malloc_trim import HeapTrimmer

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        stepper: Stepper,
        *,
        max_batch: int,
        max_batch_tokens: int,
        threads: int | None = None,
        step_target_s: float = 0.0,
    ) -> None:
        self.stepper = stepper
        self.pace = Pace(ceiling=stepper.prefill_chunk, target_s=step_target_s)
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self._threads = threads
        self._cv = threading.Condition()  # guards the inbox, the releases and stopping
        self._inbox: list[Job] = []
        self._active: list[Job] = []  # owned by the worker thread
        self._released: list[str] = []
        self._order = itertools.count()
        self._stopping = False
        self.failure: str | None = None  # why the worker thread broke down, if it did
        self.trimmer = HeapTrimmer()  # what prefills and ended requests freed goes back to the system
        self._thread = threading.Thread(target=self._run, name="prismgate-transformers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Stop the worker; requests still running end CANCELLED."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    # -- called from the event loop ----------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self.failure is not None:
                raise GatewayError(Code.UNAVAILABLE, f"the engine has failed ({self.failure}); use another replica")
            if self._stopping:
                raise GatewayError(Code.UNAVAILABLE, "the engine is shutting down")
            job.order = next(self._order)
            self._inbox.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        if not job.channel.closed:
            with self._cv:
                job.channel.closed = True
                self._cv.notify()

    def hold(self, job: Job, held: bool, *, drop: bool = False) -> None:
        """Hold ``job`` at its next step boundary (preempted: its cache stays, or with ``drop`` is freed
        there and recomputed when it goes on), or let it go on."""
        with self._cv:
            job.on_hold = held
            job.drop = held and drop
            self._cv.notify()

    def release(self, session_key: str) -> None:
        with self._cv:
            self._released.append(session_key)
            self._cv.notify()

    def in_flight(self) -> int:
        with self._cv:
            return sum(1 for job in self._active if not job.ended) + len(self._inbox)

    # -- the worker thread ---------------------------------------------------------------------

    def _run(self) -> None:
        """Serve until stopped. Should the loop itself break (a bug: model work is guarded), every
        request still here fails at once rather than waiting forever, and the engine reports FAILED."""
        try:
            self._serve()
        except BaseException as exc:
            log.exception("the transformers engine's worker thread failed")
            with self._cv:
                self.failure = f"{type(exc).__name__}: {exc}"
                self._stopping = True
                leftover = self._active + self._inbox
                self._active, self._inbox = [], []
            error = GatewayError(Code.INTERNAL, f"engine error: the worker thread failed: {self.failure}")
            for job in leftover:
                if not job.ended:
                    job.emit(error)
            return
        with self._cv:
            leftover = self._active + self._inbox
            self._active, self._inbox = [], []
        for job in leftover:
            job.emit(Done(job.prompt_len, job.generated, FinishReason.CANCELLED))

    def _serve(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        stepper = self.stepper
        while True:
            with self._cv:
                while not (self._inbox or self._released or self._stopping) and not any(
                    job.cancelled or job.drop or not job.idle for job in self._active
                ):
                    if not self._active and self.trimmer.pending:
                        # idle: what the last requests' answers freed (built after they ended) goes back too
                        if not self._cv.wait(timeout=self.trimmer.interval_s):
                            self.trimmer.maybe()
                        continue
                    self._cv.wait(timeout=0.05 if self._active else None)
                if self._stopping:
                    return
                released, dropping = self._take_in()
            self._settle_in(released, dropping)
            members = list(self._active)  # this round's: those who arrive during it cut in (_cut_in), no more
            cut_in = False
            chunks = self._paced()
            # Requests with no token yet step first, a newcomer's first step ahead of the other prompts'
            # chunks: its first token waits for nobody else's next one nor another prompt's chunk. Then
            # every decode step, which those just given their first token join at once.
            fresh = sorted((job for job in self._active if job.generated == 0), key=_begins)
            # the decode steps ride in the round's first prompt chunk that will carry them, in its pass
            others = [job for job in self._active if job not in fresh]
            riding = self._riding(
                fresh, chunks, riding_members(others, max_batch=self.max_batch, max_batch_tokens=self.max_batch_tokens)
            )
            ridden = self._first_steps(fresh, chunks, riding)
            batched = list(riding[1]) if riding is not None and ridden else []
            # those given their first token this round decode in it, unless the others' steps rode in a
            # chunk: then they join them next round rather than take a pass of their own
            rest = [job for job in members if job not in batched and not (ridden and job in fresh)]
            groups = batch_groups(rest, max_batch=self.max_batch, max_batch_tokens=self.max_batch_tokens)
            alone = [
                job
                for job in members
                if not (any(job in group for group in groups) or job in batched)
                and not (job in fresh and not (job.decoding and not ridden))
            ]
            for i, batch in enumerate(groups):
                rode = False
                if not cut_in:  # the batch's steps ride in the chunk of a newcomer that cuts in
                    cut_in, rode = self._cut_in({*itertools.chain(*groups[i:]), *alone}, batch)
                if not rode:
                    self._guarded(batch, functools.partial(decode_batch, stepper, batch))
            for i, job in enumerate(alone):
                if not cut_in:
                    cut_in, _ = self._cut_in(set(alone[i:]))
                if job.refilling:  # its dropped keys and values run again in the round's prefill
                    if job.order in chunks or job.cancelled:
                        self._prefill(job, chunks.get(job.order))
                else:
                    self._step_alone(job)
            with self._cv:
                ended = any(job.ended for job in self._active)
                self._active = [job for job in self._active if not job.ended]
            if ended or fresh or dropping or cut_in:  # requests freed memory, or prefills grew and dropped it
                self.trimmer.maybe()

    def _take_in(self) -> tuple[list[str], list[Job]]:
        """With the lock held: the inbox joins the active requests; the sessions released, and the requests
        the core preempted for memory, whose keys and values go now (:meth:`_settle_in`)."""
        self._active.extend(self._inbox)
        self._inbox.clear()
        self._active.sort(key=lambda job: (job.request.spec.priority, job.order))
        released, self._released = self._released, []
        dropping = [job for job in self._active if job.drop]
        for job in dropping:
            job.drop = False
        return released, dropping

    def _settle_in(self, released: list[str], dropping: list[Job]) -> None:
        """Outside the lock: forget the ``released`` sessions' caches and free ``dropping``'s keys and values."""
        for key in released:
            self.stepper.caches.forget(key)
        for job in dropping:
            self.stepper.drop(job)

    def _cut_in(self, pending: set[Job], carry: list[Job] | None = None) -> tuple[bool, bool]:
        """Between two passes of a round, once a round: newcomers that arrived during it and whose prompts
        end in their first chunk take that step now rather than after the rest of the round, so that they
        wait for the pass under way, not the round (the others begin next round); the next batch,
        ``carry``, rides in their chunk where it can, as the decode steps ride in a round's first chunk.
        Not while a request the core preempted for memory is among the ``pending`` passes: its keys and
        values go only after its step. Whether any cut in, and whether ``carry``'s steps rode (then they
        are taken)."""
        with self._cv:
            if not self._inbox or any(job.drop for job in pending):
                return False, False
            waiting = [job for job in self._inbox if not (job.ended or job.cancelled or job.idle)]
            chunks = self._plan(waiting, others_wait=True)
            # only a prompt that ends in its chunk: a longer one gains little (its first token is rounds
            # away) and would hold up the round's decode steps for a chunk
            newcomers = sorted((job for job in waiting if chunks.get(job.order, 0) >= job.to_prefill), key=_begins)
            if not newcomers:
                return False, False
            released, dropping = self._take_in()
        self._settle_in(released, dropping)
        return True, self._first_steps(newcomers, chunks, self._riding(newcomers, chunks, carry or []))

    def _first_steps(self, fresh: list[Job], chunks: dict[int, int], riding: tuple[Riders, list[Job]] | None) -> bool:
        """The steps of ``fresh`` (requests with no token yet, in the order they go): their chunks this
        round (``chunks``), those that ask for nothing but logits in one pass (:meth:`_together`), the
        first that may carrying ``riding``'s decode steps (:func:`_carried`); then those steps, if they
        rode. Whether they did."""
        together = self._together(fresh, chunks)
        if together:
            self._prefill_together(together, chunks, _carried(together[0], riding))
        for job in fresh:
            if job in together:
                continue
            if not job.prefilling:
                self._step_alone(job)
            elif job.order in chunks or job.cancelled:
                self._prefill(job, chunks.get(job.order), _carried(job, riding))
        if riding is None or riding[0].logits is None:
            return False
        self._guarded(riding[1], functools.partial(decode_batch, self.stepper, riding[1], riding[0].logits))
        return True

    def _paced(self) -> dict[int, int]:
        """This round's prefill chunks, by request order: who prefills, and how many tokens."""
        waiting = [job for job in self._active if not (job.ended or job.cancelled or job.idle)]
        return self._plan(waiting, others_wait=any(not job.prefilling for job in waiting))

    def _plan(self, jobs: list[Job], *, others_wait: bool) -> dict[int, int]:
        """The pace's chunks for those of ``jobs`` still prefilling, by request order."""
        prefills = [
            Prefill(job.order, len(job.cached), job.to_prefill, job.prompt_outputs and not job.refilling)
            for job in jobs
            if job.prefilling
        ]
        return self.pace.plan(prefills, others_wait=others_wait)

    def _riding(self, fresh: list[Job], chunks: dict[int, int], jobs: list[Job]) -> tuple[Riders, list[Job]] | None:
        """``jobs``' decode steps made ready to ride in a prompt chunk of ``fresh`` this round, and ``jobs``:
        those of the batch the others would form, or of the one request decoding
        (:func:`~prismgate.engines.hf.batched_decode.riding_members`). None when no chunk runs that
        would carry them (:func:`_carried`) or any of them asks for a pass of its own
        (:func:`~prismgate.engines.hf.batched_decode.riders`)."""
        if not (self.stepper.rides and jobs) or all(job.order not in chunks or _below(job, jobs) for job in fresh):
            return None
        found: list[Riders | None] = [None]

        def prepare() -> None:  # merging their caches is model work: a failure fails them, as their step would
            found[0] = riders(self.stepper, jobs)

        if not self._guarded(jobs, prepare) or found[0] is None:
            return None
        return found[0], jobs

    def _together(self, fresh: list[Job], chunks: dict[int, int]) -> list[Job]:
        """The newcomers whose chunks this round run in one pass: begun, each asking for nothing but
        logits (:meth:`Stepper.shares`), each chunk the rest of its prompt, of the first one's priority
        and, like it, of a key with nothing else running or not (:func:`_alone`), in their order while
        their tokens fit in one chunk (``prefill_chunk``, what a pass is sized for); none unless two or
        more do."""
        stepper = self.stepper
        if not stepper.rides:
            return []
        together: list[Job] = []
        tokens = 0
        for job in fresh:
            if job.order not in chunks or job.ended or job.cancelled or job.idle:
                continue
            if together and _sharing(job) != _sharing(together[0]):
                continue  # a key with nothing else running waits for none of the others' tokens, nor they for its
            if not job.started and not self._guarded([job], functools.partial(stepper.begin, job)):
                continue
            if not stepper.shares(job):
                continue
            size = stepper.chunk_end(job, chunks[job.order]) - job.next_prefill
            # only chunks that end their prompts: a longer prompt's chunk would hold back the others'
            # first tokens, which would have come before it (its chunk runs after theirs)
            if job.next_prefill + size == job.prompt_len and tokens + size <= stepper.prefill_chunk:
                together.append(job)
                tokens += size
        return together if len(together) >= 2 else []

    def _prefill_together(
        self, jobs: list[Job], chunks: dict[int, int], riding: tuple[Riders, list[Job]] | None
    ) -> None:
        """The chunks of ``jobs`` in one pass, carrying ``riding``'s decode steps, timed for the pace."""
        contexts = [len(job.cached) for job in jobs]
        started = self.pace.clock()
        carried = riding[0] if riding is not None else None
        work = functools.partial(self.stepper.step_together, jobs, [chunks[job.order] for job in jobs], carried)
        if self._guarded(jobs, work, riding):
            tokens = sum(len(job.cached) - context for job, context in zip(jobs, contexts, strict=True))
            self.pace.record(max(contexts), tokens, False, self.pace.clock() - started)

    def _prefill(self, job: Job, chunk: int | None, riding: tuple[Riders, list[Job]] | None = None) -> None:
        """A prefill chunk of ``job``, timed for the pace, carrying ``riding``'s decode steps where it can
        (a pass that fails after it began writing their keys and values fails them too)."""
        before, refilling, started = len(job.cached), job.refilling, self.pace.clock()
        outputs = job.prompt_outputs and not refilling
        if self._step_alone(job, chunk, riding):
            # a request's first step may have found its prompt's start kept
            context = before if refilling else max(before, job.reused)
            self.pace.record(context, len(job.cached) - context, outputs, self.pace.clock() - started)

    def _step_alone(self, job: Job, chunk: int | None = None, riding: tuple[Riders, list[Job]] | None = None) -> bool:
        """One step of ``job`` (a prefill chunk, or a decode step outside the batch), carrying ``riding``'s
        decode steps where it can; whether one ran."""
        if job.ended:
            return False
        if job.cancelled:
            self.stepper.end(job, FinishReason.CANCELLED)
            return False
        if job.idle:
            return False
        carried = riding[0] if riding is not None else None
        return self._guarded([job], functools.partial(self.stepper.step, job, chunk, carried), riding)

    def _guarded(
        self, jobs: list[Job], work: Callable[[], None], riding: tuple[Riders, list[Job]] | None = None
    ) -> bool:
        """Run model work for ``jobs``; a failure fails those requests (and ``riding``'s, when the pass that
        failed had begun writing their keys and values), never the worker. Whether it succeeded."""
        try:
            with torch.inference_mode():
                work()
            return True
        except Exception as exc:  # the model failed: report it, keep serving
            if riding is not None and riding[0].started and riding[0].logits is None:
                jobs = [*jobs, *riding[1]]
            error = exc if isinstance(exc, GatewayError) else None
            if error is None:
                log.exception("requests %s failed", [job.request.request_id for job in jobs])
                error = GatewayError(Code.INTERNAL, f"engine error: {type(exc).__name__}: {exc}")
            for job in jobs:
                if not job.ended:
                    self.stepper.fail(job, error)
            return False


def _begins(job: Job) -> tuple[bool, int, float]:
    """The order in which a round's requests with no token yet step: newcomers ahead of prompts already
    under way, then by priority, then by the fair share's rank
    (:attr:`~prismgate.core.engine.EngineRequest.rank`: a key far below its share first); first come
    within each."""
    return job.started, job.request.spec.priority, job.request.rank


def _carried(job: Job, riding: tuple[Riders, list[Job]] | None) -> tuple[Riders, list[Job]] | None:
    """The decode steps ``job``'s prompt chunk carries: ``riding``'s, unless they rode in another already,
    or ``job``'s key had nothing else running and each of theirs had (:func:`_below`: its first token
    waits for none of their steps, which ride in a later chunk or take their own pass)."""
    return None if riding is None or riding[0].started or _below(job, riding[1]) else riding


def _below(job: Job, riders: list[Job]) -> bool:
    """Whether ``job``'s key had nothing else running as it started, and each of ``riders``' had."""
    return _alone(job) and not any(_alone(rider) for rider in riders)


def _sharing(job: Job) -> tuple[int, bool]:
    """What newcomers whose prompts share a pass have in common: priority, and whether their key had
    nothing else running (:func:`_alone`)."""
    return job.request.spec.priority, _alone(job)


def _alone(job: Job) -> bool:
    """Whether ``job``'s key had nothing else running as it started (rank 0: the fair share's newcomer key)."""
    return job.request.rank == 0
