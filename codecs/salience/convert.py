"""salience.v1 wire messages <-> core objects. Pure functions: no I/O, no policy.

The rules (offsets, image runs, context limits, readout availability) are the core's;
this module only fills in the wire's documented defaults and copies fields across.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from prismgate.core.actions import GenerateAction, GenerateSpec, ImageInput, PositionRange
from prismgate.core.engine import ReadoutManifest
from prismgate.core.errors import invalid
from prismgate.core.events import Done, FinishReason, TokenEvent
from prismgate.schemas import salience_pb2 as pb

ORIGIN = "salience"

_Finish = pb.GenerateDone.FinishReason

FINISH_REASONS: dict[FinishReason, pb.GenerateDone.FinishReason] = {
    FinishReason.EOS: _Finish.FINISH_REASON_EOS,
    FinishReason.LENGTH: _Finish.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: _Finish.FINISH_REASON_CANCELLED,
    FinishReason.STOP_STRING: _Finish.FINISH_REASON_STOP_STRING,
    # max_tokens=0: the decode budget (zero) was reached. completion_tokens=0 tells the
    # two LENGTH cases apart; UNSPECIFIED would read as "the server forgot to say".
    FinishReason.PREFILL_ONLY: _Finish.FINISH_REASON_LENGTH,
}


def _ranges(ranges: Iterable[pb.PositionRange]) -> tuple[PositionRange, ...]:
    return tuple(PositionRange(r.start, r.end) for r in ranges)


def spec_from_request(request: pb.GenerateRequest) -> GenerateSpec:
    """The wire's sampling defaults: temperature 0 -> 1.0, top_p 0 -> 1.0, top_k 0 -> off.

    So a zero-valued request samples from the full distribution; greedy decoding over
    Salience is ``top_k = 1``.
    """
    return GenerateSpec(
        max_tokens=request.max_tokens,
        temperature=request.temperature if request.temperature != 0 else 1.0,
        top_p=request.top_p if request.top_p != 0 else 1.0,
        top_k=request.top_k,
        stop_token_ids=tuple(request.stop_token_ids),
        logprob_ranges=_ranges(request.logprobs_ranges),
        logprob_top_k=request.logprob_top_k,
        readout_ranges=_ranges(request.readout_ranges),
        priority=request.priority,
    )


DETERMINISTIC_KEY = "prismgate-deterministic"  # request metadata: "true" or "false"; absent: the server's default
SEED_KEY = "prismgate-seed"  # request metadata: the sampling seed, an integer in [0, 2**63)


def metadata_options(deterministic: str | None, seed: str | None) -> dict[str, Any]:
    """What salience.v1 has no field for, read from the request's metadata (the proto never changes)."""
    options: dict[str, Any] = {}
    if deterministic is not None:
        if deterministic.lower() not in ("true", "false"):
            raise invalid(f"metadata {DETERMINISTIC_KEY} must be true or false, got {deterministic[:40]!r}")
        options["deterministic"] = deterministic.lower() == "true"
    if seed is not None:
        if not seed.isascii() or not seed.isdigit() or len(seed) > 19:
            raise invalid(f"metadata {SEED_KEY} must be an integer in [0, 2**63), got {seed[:40]!r}")
        options["seed"] = int(seed)
    return options


def action_from_request(request: pb.GenerateRequest, **options: Any) -> GenerateAction:
    """A GenerateRequest as a core action; the offset is always checked (Salience sessions are shared).

    ``options`` are spec fields salience.v1 cannot carry (:func:`metadata_options`).
    """
    images = tuple(
        ImageInput(data=im.bytes, mime=im.mime, start=im.pad_range_start, end=im.pad_range_end) for im in request.images
    )
    return GenerateAction(
        append_tokens=tuple(request.append_tokens),
        images=images,
        offset=request.offset,
        truncating=request.truncating,
        spec=replace(spec_from_request(request), **options) if options else spec_from_request(request),
        origin=ORIGIN,
    )


def token_event(event: TokenEvent) -> pb.GenerateEvent:
    """One position: id, readout flattened row-major ``[n_layers][n_concepts]``, logprobs if computed."""
    token = pb.Token(id=event.id, position=event.position, is_prefill=event.is_prefill)
    if event.readout is not None:
        token.readout.extend(event.readout.reshape(-1).tolist())
    if event.logprob is not None:
        token.sampled_logprob = event.logprob
        token.has_sampled_logprob = True
    if event.top_logprobs:
        token.logprobs.extend(pb.TokenLogprob(id=i, logprob=lp) for i, lp in event.top_logprobs)
    return pb.GenerateEvent(token=token)


def done_event(done: Done) -> pb.GenerateEvent:
    return pb.GenerateEvent(
        done=pb.GenerateDone(
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            total_tokens=done.total_tokens,
            finish_reason=FINISH_REASONS[done.finish_reason],
        )
    )


def manifest(readouts: ReadoutManifest | None) -> pb.ReadoutManifest:
    """The loaded concept pack; with none loaded, an empty manifest (readout_ranges then fail)."""
    if readouts is None:
        return pb.ReadoutManifest()
    return pb.ReadoutManifest(
        concepts=list(readouts.concepts),
        layers=list(readouts.layers),
        hidden_size=readouts.hidden_size,
        dtype=readouts.dtype,
    )
