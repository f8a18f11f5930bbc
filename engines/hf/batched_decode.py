"""The batched decode step: the decode steps of several requests in one forward pass.

On a small model a decode step is dominated by per-call overhead, not arithmetic, so
requests that are all decoding share one forward pass, each row steered as its own request
asks (:mod:`~prismgate.engines.hf.steering`). Each keeps its own KV cache (a
session keeps it between turns); their caches are merged into one, padded to the longest,
and the merge is kept while the same requests decode together
(:mod:`~prismgate.engines.hf.batch_cache`): it is rebuilt only when one joins or leaves.
The padding is memory, so a batch is capped by ``max_batch`` requests and by ``max_batch_tokens``
(its size times its longest context). A batch with a deterministic request in it runs the
batch-invariant kernels for every row (:mod:`~prismgate.engines.hf.invariant`).
"""

from __future__ import annotations

import torch

from prismgate.core.actions import covered
from prismgate.engines.hf.job import Job
from prismgate.engines.hf.mixed_pass import Riders
from prismgate.engines.hf.steps import Stepper
from prismgate.engines.invariant_rows import SWITCH


def batch_members(jobs: list[Job], *, max_batch: int, max_batch_tokens: int) -> list[Job]:
    """The first of ``jobs`` (in their order) whose next step is a plain decode step, as many as
    fit in one batch; none when fewer than two do (one request alone takes the plain step).

    Every member's cache is padded to the longest, and the padding is memory no request's
    budget counts (a 3,516-token prompt decoding beside seven short chats would hold eight times
    its keys and values), so a request joins only while the padding stays within
    :func:`padding_allowance`. A request too long for the others decodes on its own, and
    the others still batch together.
    """
    if max_batch < 2:
        return []
    ready = _ready(jobs)
    for first in range(len(ready) - 1):
        members = _fill(ready[first:], max_batch, max_batch_tokens)
        if len(members) >= 2:
            return members
    return []


def batch_groups(jobs: list[Job], *, max_batch: int, max_batch_tokens: int) -> list[list[Job]]:
    """The plain decode steps of ``jobs`` as batches: :func:`batch_members`, then the same of what is
    left, until fewer than two are (one left over takes the plain step). Each batch keeps a merged
    cache of its own (:class:`~prismgate.engines.hf.batch_cache.BatchCaches`), so a round with more
    decoding requests than one batch takes runs a pass per batch, not a pass per request."""
    groups: list[list[Job]] = []
    left = list(jobs)
    while members := batch_members(left, max_batch=max_batch, max_batch_tokens=max_batch_tokens):
        groups.append(members)
        left = [job for job in left if job not in members]
    return groups


def riding_members(jobs: list[Job], *, max_batch: int, max_batch_tokens: int) -> list[Job]:
    """The decode steps that may ride in a prompt chunk's pass: the batch :func:`batch_members` would
    form, or the one request ready to decode; none otherwise."""
    members = batch_members(jobs, max_batch=max_batch, max_batch_tokens=max_batch_tokens)
    ready = members or _ready(jobs)
    return ready if members or len(ready) == 1 else []


def _ready(jobs: list[Job]) -> list[Job]:
    """Those of ``jobs`` whose next step is a plain decode step, to be taken now."""
    return [job for job in jobs if not (job.cancelled or job.idle or not job.decoding)]


def padding_allowance(tokens: int, max_batch_tokens: int) -> int:
    """Padding positions a batch may hold beside its members' ``tokens``: a quarter of them, or an
    eighth of ``max_batch_tokens`` (2,048 by default), whichever is more."""
    return max(tokens // 4, max_batch_tokens // 8)


def _fill(ready: list[Job], max_batch: int, max_batch_tokens: int) -> list[Job]:
    members: list[Job] = []
    width = tokens = 0
    for job in ready:
        position = len(job.timeline) - 1
        padded = max(width, position) * (len(members) + 1)
        if padded > max_batch_tokens:
            continue  # padding every cache to the longest would hold too much
        if padded - (tokens + position) > padding_allowance(tokens + position, max_batch_tokens):
            continue
        members.append(job)
        width, tokens = max(width, position), tokens + position
        if len(members) == max_batch:
            break
    return members


def riders(stepper: Stepper, jobs: list[Job]) -> Riders | None:
    """The decode steps of ``jobs`` as rows that may ride in a prompt chunk's pass
    (:mod:`~prismgate.engines.hf.mixed_pass`): None when riding is off here or any of them asks for
    what only a pass of its own gives (a readout or features of the token it feeds, steering, the
    batch-invariant kernels). Several are merged in the batch's cache, one keeps its own."""
    if not (stepper.rides and jobs):
        return None
    positions = [len(job.timeline) - 1 for job in jobs]
    for job, position in zip(jobs, positions, strict=True):
        if job.deterministic or job.steering or stepper.waits_for_hidden(job.request.spec, position):
            return None
    ids = [job.timeline[p] for job, p in zip(jobs, positions, strict=True)]
    if len(jobs) == 1:
        stepper.batches.leave(jobs[0].cache)
        return Riders(ids, positions, jobs[0].cache)
    caches = [job.cache for job in jobs]
    batch = stepper.batches.holding(caches)
    batch.prepare(caches, positions)
    return Riders(ids, positions, batch.merged, batch.mask())


def decode_batch(stepper: Stepper, jobs: list[Job], ridden: torch.Tensor | None = None) -> None:
    """Feed each job's last sampled token in one forward pass, then sample each job's next token.

    ``ridden``: that pass already ran, inside a prompt chunk's (:func:`riders`), and these are its
    logits. A job that ends on this step with its last token still held (its readout or features come
    from the pass that feeds it) gets that pass too; the jobs ending together share it, so a batch
    of requests that end on the same step costs one more batched pass, not one pass each.
    """
    logits = _feed_batch(stepper, jobs, ridden)
    for row, job in enumerate(jobs):
        job.next_logits = logits[row]
        stepper.decode_one(job)
    ending = [job for job in jobs if job.finish is not None and job.held is not None]
    if len(ending) >= 2:  # one alone takes the plain step in finish_if_done
        _feed_batch(stepper, ending)
    for job in jobs:
        stepper.finish_if_done(job)


def _feed_batch(stepper: Stepper, jobs: list[Job], ridden: torch.Tensor | None = None) -> torch.Tensor:
    """Run each job's last timeline token through one forward pass (unless it ran already: ``ridden``
    are its logits); a held event gets its readout and features from it and is sent. Returns the
    logits ``[batch, vocab]``."""
    positions = [len(job.timeline) - 1 for job in jobs]
    if ridden is not None:  # riders ask for nothing but logits (`riders`)
        for job, position in zip(jobs, positions, strict=True):
            job.cached.append(job.timeline[position])
            job.invariant = False
        stepper.stats["ridden_steps"] += 1
        return ridden
    probe = stepper.probe
    wants = [
        probe is not None and covered(job.request.spec.readout_ranges, p)
        for job, p in zip(jobs, positions, strict=True)
    ]
    if probe is not None:
        probe.enabled = any(wants)
    features = stepper.features
    fspecs = [
        job.request.spec.features
        if job.request.spec.features is not None and covered(job.request.spec.features.ranges, p)
        else None
        for job, p in zip(jobs, positions, strict=True)
    ]
    want_features = features is not None and features.arm(fspecs)
    rows = [job.steer(row, p, p + 1) for row, (job, p) in enumerate(zip(jobs, positions, strict=True))]
    invariant = any(job.deterministic for job in jobs)  # the kernels are per pass: every row gets them
    with stepper.steered(rows) as gates, SWITCH.on(invariant):
        caches = [job.cache for job in jobs]
        ids = [job.timeline[p] for job, p in zip(jobs, positions, strict=True)]
        logits = stepper.batches.holding(caches).step(ids, caches, positions)
    readouts = probe.take_batch() if probe is not None and any(wants) else None
    feats = features.take() if want_features and features is not None else None
    stepper.stats["batched_steps"] += 1
    for row, (job, position) in enumerate(zip(jobs, positions, strict=True)):
        job.cached.append(job.timeline[position])
        job.invariant = job.invariant and invariant
        job.record_gates(gates, row, 1)
        if job.held is not None:
            if readouts is not None and wants[row]:
                job.held.readout = readouts[row, 0]
            fspec = fspecs[row]
            if feats is not None and fspec is not None:
                job.held.features = feats.features(row, 0, fspec)
            job.emit(job.held)
            job.held = None
    return logits
