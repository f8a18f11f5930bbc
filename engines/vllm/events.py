"""Gateway events from what vLLM and the side channel report.

vLLM's ``RequestOutput`` gives the decoded tokens, their logprobs and how the request
ended; the worker's rows (:mod:`.tracker`) and the session store (:mod:`.store`) give
readouts and prompt logprobs. This module turns those into :class:`TokenEvent` and
:class:`FinishReason` values, and vLLM's exceptions into :class:`GatewayError` values.
Nothing here talks to vLLM or waits: it only translates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prismgate.core.actions import GenerateSpec, covered
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.events import FinishReason, TokenEvent
from prismgate.core.features import Features
from prismgate.engines.vllm.channel import LogprobRow
from prismgate.engines.vllm.plan import Plan

EventLogprob = tuple[float, list[tuple[int, float]] | None]  # own logprob, top-k best first (None when k = 0)

_FINISH = {"stop": FinishReason.EOS, "length": FinishReason.LENGTH, "abort": FinishReason.CANCELLED}


def prompt_events(
    tokens: Sequence[int],
    spec: GenerateSpec,
    plan: Plan,
    readouts: dict[int, Any],
    logprobs: dict[int, EventLogprob],
    features: dict[int, Features] | None = None,
) -> list[TokenEvent]:
    """One event per prompt position the request covers, with the values it asked for there."""
    events: list[TokenEvent] = []
    features = features or {}
    wanted = sorted(set(plan.ro_prompt) | set(plan.lp_prompt) | set(plan.fe_prompt) | ({0} if plan.lp_zero else set()))
    for p in wanted:
        event = TokenEvent(id=int(tokens[p]), position=p, is_prefill=True)
        if p in logprobs and covered(spec.logprob_ranges, p):
            event.logprob, event.top_logprobs = logprobs[p]
        if p in readouts and covered(spec.readout_ranges, p):
            event.readout = readouts[p]
        event.features = features.get(p)
        events.append(event)
    return events


def decode_event(token: int, position: int, spec: GenerateSpec, plan: Plan, logprobs: Any, j: int) -> TokenEvent:
    """The event of a decoded token; ``logprobs[j]`` is vLLM's logprob dict for it, when it sent them."""
    event = TokenEvent(id=token, position=position, is_prefill=False)
    if plan.decode_logprobs and covered(spec.logprob_ranges, position) and logprobs:
        event.logprob, event.top_logprobs = decode_logprob(logprobs[j], token, spec.logprob_top_k)
    return event


def stop_after(token: int, generated: int, plan: Plan, spec: GenerateSpec) -> FinishReason | None:
    """Why decoding ends after ``token`` (the ``generated``-th), or None when it goes on."""
    if generated > spec.min_tokens and token in plan.stop_ids:
        return FinishReason.EOS
    if generated >= spec.max_tokens:
        return FinishReason.LENGTH
    return None


def finish_reason(completion: Any) -> FinishReason:
    """The finish reason of a finished vLLM completion (anything unexpected counts as cancelled)."""
    reason = completion.finish_reason if completion is not None else None
    return _FINISH.get(str(reason), FinishReason.CANCELLED)


def aborted(out: Any) -> bool:
    """True when this output ends the request as aborted (the engine was closing, or a client let go)."""
    completion = out.outputs[0] if out.outputs else None
    return bool(out.finished) and (completion is None or str(completion.finish_reason) == "abort")


def cached_tokens(out: Any, n: int) -> int:
    """Prompt tokens vLLM served from its cache, after checking it saw the session's ``n`` positions."""
    ids = getattr(out, "prompt_token_ids", None)
    if ids is not None and len(ids) != n:
        raise GatewayError(
            Code.INTERNAL,
            f"vLLM expanded the prompt to {len(ids)} tokens, the session holds {n}: "
            "an image became a different number of tokens than the model's processor reported",
        )
    return int(out.num_cached_tokens or 0)


def row_logprob(row: LogprobRow, k: int) -> EventLogprob:
    """A side-channel logprob row as an event's (logprob, top-k)."""
    _, value, ids, vals = row
    return float(value), (
        best_first([(int(i), float(v)) for i, v in zip(ids, vals, strict=True)])[:k] if k > 0 else None
    )


def best_first(pairs: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Top logprobs most likely first, the lowest id first among equals (as the transformers engine
    orders them): greedy decoding's token, the first of equal maxima, heads the list."""
    return sorted(pairs, key=lambda pair: (-pair[1], pair[0]))


def decode_logprob(entry: Any, token: int, k: int) -> tuple[float | None, list[tuple[int, float]] | None]:
    """vLLM's per-token dict {id: Logprob(logprob, rank)} -> (own logprob, top-k best first)."""
    own = entry.get(token)
    value = float(own.logprob) if own is not None else None
    if k <= 0:
        return value, None
    ranked = best_first(
        [(int(tid), float(lp.logprob)) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    )
    return value, ranked[:k]


def map_error(exc: Exception) -> GatewayError:
    """vLLM's exceptions as gateway errors: a dead engine is UNAVAILABLE, a refused request INVALID."""
    name = type(exc).__name__
    if name in {"EngineDeadError"}:
        return GatewayError(Code.UNAVAILABLE, f"the vLLM engine died: {exc}")
    if name in {"VLLMValidationError", "ValueError", "VLLMClientError"}:
        return invalid(f"vLLM rejected the request: {exc}")
    cause = exc.__cause__
    if name == "EngineGenerateError" and cause is not None:
        return map_error(cause) if isinstance(cause, Exception) else GatewayError(Code.INTERNAL, str(cause))
    return GatewayError(Code.INTERNAL, f"vLLM engine error: {name}: {exc}")
