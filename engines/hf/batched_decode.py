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

from prismgate.core.actions import covered
from prismgate.engines.hf.job import Job
from prismgate.engines.hf.steps import Stepper
from prismgate.engines.invariant_rows import SWITCH


def batch_members(jobs: list[Job], *, max_batch: int, max_batch_tokens: int) -> list[Job]:
    """The first of ``jobs`` (in their order) whose next step is a plain decode step, as many
    as fit in one batch; none when fewer than two do (one request alone takes the plain step)."""
    if max_batch < 2:
        return []
    members: list[Job] = []
    width = 0
    for job in jobs:
        if job.cancelled or job.channel.paused or not job.decoding:
            continue
        position = len(job.timeline) - 1
        if max(width, position) * (len(members) + 1) > max_batch_tokens:
            continue  # padding every cache to the longest would hold too much
        members.append(job)
        width = max(width, position)
        if len(members) == max_batch:
            break
    return members if len(members) >= 2 else []


def decode_batch(stepper: Stepper, jobs: list[Job]) -> None:
    """Feed each job's last sampled token in one forward pass, then sample each job's next token."""
    probe = stepper.probe
    positions = [len(job.timeline) - 1 for job in jobs]
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
        logits = stepper.batch.step(
            [job.timeline[p] for job, p in zip(jobs, positions, strict=True)], [job.cache for job in jobs], positions
        )
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
        job.next_logits = logits[row]
        stepper.decode_one(job)
        stepper.finish_if_done(job)
