"""Per-request planning: what a request needs, decided before it is submitted to vLLM.

A request may want readouts and logprobs at prompt positions, some of which the session's
store already holds (:mod:`.store`); logprobs at decoded positions, which vLLM reports
itself; and readouts at decoded positions, which need one step of look-ahead. From that
follow what the worker is asked to send over the side channel, and whether the prefix
cache must be skipped because a missing value lies where it would answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prismgate.core.actions import PositionRange, covered
from prismgate.core.engine import EngineInfo, EngineRequest
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.features import FeatureSpec
from prismgate.engines.vllm.store import SessionValues


@dataclass
class Plan:
    """What one request needs, decided before it is submitted."""

    n: int
    ro_prompt: list[int]  # prompt positions whose readouts the client asked for
    lp_prompt: list[int]  # prompt positions (>= 1) whose logprobs the client asked for
    lp_zero: bool  # position 0 is covered by a logprob range (it has no logprob: an event without one)
    decode_logprobs: bool
    lookahead: bool
    stop_ids: frozenset[int]
    values: SessionValues = field(default_factory=SessionValues)
    decode_readouts: bool = False  # a decoded position's readout is asked for
    fe_prompt: list[int] = field(default_factory=list)  # prompt positions whose SAE features the client asked for
    features: FeatureSpec | None = None  # the request's, when the model has SAEs
    top: int = 0  # the most top features per layer the worker keeps (what a session stores)

    def missing(self, top_k: int) -> tuple[list[int], list[int]]:
        """Prompt positions whose readouts / logprobs the store does not hold."""
        ro = [p for p in self.ro_prompt if p not in self.values.readouts]
        lp = [p for p in self.lp_prompt if self.values.logprob(p, top_k) is None]
        return ro, lp

    def missing_features(self) -> list[int]:
        """Prompt positions whose features the store does not hold (or not as many, or not these watched ids)."""
        spec = self.features
        if spec is None:
            return []
        stored = self.values.features
        return [p for p in self.fe_prompt if p not in stored or not stored[p].serves(spec, self.top)]


def check(request: EngineRequest, info: EngineInfo, has_readouts: bool) -> None:
    """Refuse what vLLM must never see: context overruns, bad ids, readouts or images the model lacks."""
    spec = request.spec
    n = len(request.tokens)
    limit = info.max_model_len
    if n + spec.max_tokens > limit:
        raise GatewayError(
            Code.RESOURCE_EXHAUSTED,
            f"{n} prompt tokens + max_tokens {spec.max_tokens} = {n + spec.max_tokens} exceeds the model's "
            f"context of {limit}",
        )
    if spec.max_tokens > 0 and n == 0:
        raise invalid("cannot decode from an empty timeline: append at least one token")
    if spec.wants_readouts and not has_readouts:
        raise invalid(f"model {info.model_id!r} has no concept pack loaded, so it has no readouts")
    for i, t in enumerate(request.tokens):
        if not 0 <= t < info.vocab_size:
            raise invalid(f"token id {t} at position {i} is outside the vocabulary [0, {info.vocab_size})")
    if request.images and info.vision is None:
        raise invalid(f"model {info.model_id!r} takes no images (it has no vision encoder)")


def make_plan(
    request: EngineRequest, info: EngineInfo, has_readouts: bool, values: SessionValues, top: int = 0
) -> Plan:
    """The plan for ``request``; ``values`` are what the store holds for its session; ``top``: the
    top features per layer the worker keeps (0: the model has no SAE)."""
    spec = request.spec
    n = len(request.tokens)
    horizon = n + spec.max_tokens
    decode_ro = has_readouts and bool(positions(spec.readout_ranges, n, horizon))
    fspec = spec.features if top > 0 else None
    decode_fe = fspec is not None and bool(positions(fspec.ranges, n, horizon))  # features come from the same step
    return Plan(
        n=n,
        ro_prompt=positions(spec.readout_ranges, 0, n) if has_readouts else [],
        lp_prompt=positions(spec.logprob_ranges, 1, n),
        lp_zero=covered(spec.logprob_ranges, 0),
        decode_logprobs=bool(positions(spec.logprob_ranges, n, horizon)),
        lookahead=(decode_ro or decode_fe) and spec.max_tokens > 0,
        decode_readouts=decode_ro,
        stop_ids=spec.stop_ids(info.eos_token_ids),
        values=values,
        fe_prompt=positions(fspec.ranges, 0, n) if fspec is not None else [],
        features=fspec if fspec is not None and fspec.wanted else None,
        top=top,
    )


def must_skip_cache(plan: Plan, top_k: int, cache_block: int) -> bool:
    """Skip the prefix cache when a needed value lies where this session's cache may answer.

    vLLM caches whole blocks of computed tokens and always recomputes the last prompt
    token, so what this session can hit is its computed prefix rounded down to a block.
    """
    ro, lp = plan.missing(top_k)
    first = min([*ro, *plan.missing_features(), *(p - 1 for p in lp)], default=plan.n)
    cacheable = min(plan.values.computed, plan.n - 1) // cache_block * cache_block
    return first < cacheable


def wants(
    key: str,
    readouts: bool,
    logprob_positions: Sequence[int],
    top_k: int,
    steering: dict[str, Any] | None = None,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the worker reads from ``extra_args`` (see :mod:`.worker`): what to send, and what to steer.

    ``features``: ``{"k": top features per layer to send, "ids": watched ids}`` (:func:`feature_wants`).
    """
    out: dict[str, Any] = {"key": key, "ro": int(readouts), "lp": ranges(logprob_positions), "k": top_k}
    if steering is not None:
        out["st"] = steering
    if features is not None:
        out["fe"] = features
    return out


def feature_wants(plan: Plan, session: bool) -> dict[str, Any] | None:
    """The SAE features the worker sends for every position the request computes, or None.

    A session's turn sends the worker's every top feature (``plan.top``), so that the store
    answers any later ``top_k``; a request without a session only its own ``top_k``.
    """
    spec = plan.features
    if spec is None:
        return None
    return {"k": plan.top if session else min(spec.top_k, plan.top), "ids": list(spec.ids)}


def request_wants(
    key: str,
    request: EngineRequest,
    plan: Plan,
    has_readouts: bool,
    keep_session_readouts: bool,
    steering: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """What the worker does for this request, or None when nothing.

    Readouts travel for the positions asked for, for the look-ahead, and (to fill the
    store) for every session request; logprobs only for prompt positions the store lacks;
    SAE features for every position of a request that asks for features anywhere (the encoder
    runs only in steps where some request does, so a session turn that asks none pays nothing:
    a later turn asking about its positions then finds the store empty there and skips the cache).
    ``steering`` is the request's (:func:`.steer.worker_steering`).
    """
    ship_readouts = has_readouts and (
        bool(plan.ro_prompt) or plan.decode_readouts or (keep_session_readouts and request.session_key is not None)
    )
    top_k = request.spec.logprob_top_k
    _, missing_lp = plan.missing(top_k)
    features = feature_wants(plan, request.session_key is not None)
    if not ship_readouts and not missing_lp and steering is None and features is None:
        return None
    return wants(key, ship_readouts, missing_lp, top_k, steering, features)


def positions(ranges: Sequence[PositionRange], lo: int, hi: int) -> list[int]:
    """The positions in ``[lo, hi)`` that ``ranges`` cover, sorted."""
    out: set[int] = set()
    for r in ranges:
        out.update(range(max(r.start, lo), min(r.end, hi)))
    return sorted(out)


def ranges(positions: Sequence[int]) -> list[list[int]]:
    """Sorted positions as ``[start, end)`` runs (what the worker reads)."""
    out: list[list[int]] = []
    for p in sorted(positions):
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out
