"""A request's steering in the vLLM worker's terms, and the prefix-cache scope it needs.

The worker adds vectors from a table per steered layer (the pack's layers and each SAE's,
:func:`steering_layers`): rows for the pack's concepts, and :data:`RAW_SLOTS` rows for raw
directions and SAE features with a scale, handed out to requests in flight (:class:`RawSlots`)
so two requests never share a row. What a request steers travels in
``SamplingParams.extra_args`` with the rest of what the worker reads (:func:`.plan.wants`).

vLLM's prefix cache keys blocks by their tokens and ``cache_salt`` and knows nothing of
steering, so :func:`cache_salt` folds the steering into the salt: requests that steer alike
share blocks, others never do (docs/vllm.md, "steering and the prefix cache").

Only the core is imported here: this module is also loaded inside vLLM's worker.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.steering import Comparison, Steering, active, digest

MAX_ROUNDS = 8  # the most vectors one request may add at one layer (``vllm_steering_rounds`` picks up to this)
RAW_SLOTS = 32  # table rows per steered layer for raw directions of requests in flight
FEATURE_GATES = 8  # entries of one request gated on an SAE feature (gate value columns after the concepts')


def steering_layers(pack_layers: Sequence[int], sae_layers: Sequence[int]) -> list[int]:
    """The layers the worker steers at, in the order of their slots: the pack's, then each SAE layer not among them.

    The engine and the worker both take the order from here, so a slot names one layer on both
    sides; without SAEs a slot is the pack's own index of its layer.
    """
    return [*pack_layers, *(layer for layer in sae_layers if layer not in pack_layers)]


class RawSlots:
    """Which table row holds which request's raw direction, per steered layer."""

    def __init__(self, n_layers: int) -> None:
        self._free = [list(range(RAW_SLOTS - 1, -1, -1)) for _ in range(n_layers)]
        self._held: dict[str, list[tuple[int, int]]] = {}

    def take(self, key: str, layer: int) -> int:
        free = self._free[layer]
        if not free:
            self.release(key)
            raise GatewayError(
                Code.RESOURCE_EXHAUSTED,
                f"{RAW_SLOTS} raw steering directions are already in flight at this layer; retry shortly",
            )
        slot = free.pop()
        self._held.setdefault(key, []).append((layer, slot))
        return slot

    def release(self, key: str) -> None:
        for layer, slot in self._held.pop(key, ()):
            self._free[layer].append(slot)


def worker_steering(
    key: str,
    steering: Steering,
    prompt_len: int,
    layers: list[int],
    concepts: list[str],
    slots: RawSlots,
    rounds: int = MAX_ROUNDS,
    sae_layers: Sequence[int] = (),
) -> dict[str, Any] | None:
    """What the worker reads for ``steering`` (None: none); raw directions take slots under ``key``.

    ``layers`` and ``concepts`` are the pack's (empty without one), ``sae_layers`` the SAEs'; entries
    name a layer by its slot in :func:`steering_layers`. ``rounds`` is how many vectors the worker's
    graph adds at one layer (``vllm_steering_rounds``).

    ``e`` lists the entries in order as ``[slot, table row, scale, norm matched, positions value,
    gate, clamp]``: ``gate`` None or ``[slot, column, above, threshold]`` (column: a concept's index)
    or ``[slot, column, above, threshold, feature]`` (column: ``len(concepts)`` + the request's
    count of feature gates before it); ``clamp`` None or ``[feature, target]`` (table row 0, scale 0).
    ``raw`` the rows to fill as ``[slot, table row, unit vector]``; ``dec`` as ``[slot, table row,
    feature]``, the feature's unit decoder row, which the worker takes from its own copy of the SAE.
    """
    if not steering:
        return None
    order = steering_layers(layers, sae_layers)
    per_layer: dict[int, int] = {}
    entries: list[list[Any]] = []
    raw: list[list[Any]] = []
    dec: list[list[Any]] = []
    feature_gates = 0
    for i, entry in enumerate(steering):
        if entry.layer not in order:
            raise invalid(f"steering layer {entry.layer} is not a layer of the concept pack or of an SAE")
        index = order.index(entry.layer)
        per_layer[index] = per_layer.get(index, 0) + 1
        if per_layer[index] > rounds:
            raise invalid(
                f"this server's vLLM engine adds at most {rounds} steering vectors at one layer "
                f"(vllm_steering_rounds); layer {entry.layer} has more"
            )
        clamp: list[Any] | None = None
        if entry.feature is not None:
            if entry.layer not in sae_layers:
                raise invalid(f"steering entry {i}: layer {entry.layer} has no SAE, so no feature {entry.feature}")
            if entry.clamp is not None:
                row = 0
                clamp = [entry.feature, float(entry.clamp)]
            else:
                row = 1 + len(concepts) + slots.take(key, index)
                dec.append([index, row, entry.feature])
        elif entry.concept is not None:
            if entry.layer not in layers:
                raise invalid(f"steering layer {entry.layer} is not a layer of the concept pack")
            if entry.concept not in concepts:
                raise invalid(f"unknown steering concept {entry.concept!r}")
            row = 1 + concepts.index(entry.concept)
        else:
            row = 1 + len(concepts) + slots.take(key, index)
            raw.append([index, row, list(entry.unit_direction())])
        gate: list[Any] | None = None
        if entry.gate is not None:
            g = entry.gate
            above = int(g.comparison is Comparison.ABOVE)
            if g.feature is not None:
                if g.layer not in sae_layers:
                    raise invalid(f"steering entry {i}: gate layer {g.layer} has no SAE, so no feature {g.feature}")
                if feature_gates == FEATURE_GATES:
                    raise invalid(
                        f"steering entry {i}: gate.feature: the vllm engine gates at most {FEATURE_GATES} entries "
                        "of one request on an SAE feature"
                    )
                column = len(concepts) + feature_gates
                feature_gates += 1
                gate = [order.index(g.layer), column, above, g.threshold, g.feature]
            else:
                if g.layer not in layers or g.concept not in concepts:
                    raise invalid(f"steering gate {g.concept!r} at layer {g.layer} is not a readout of the pack")
                gate = [order.index(g.layer), concepts.index(g.concept), above, g.threshold]
        entries.append([index, row, float(entry.scale), int(entry.norm_match), entry.positions.value, gate, clamp])
    out: dict[str, Any] = {"n": prompt_len, "e": entries, "raw": raw}
    if dec:
        out["dec"] = dec
    return out


def gated(steering: Steering) -> bool:
    """Whether an entry of ``steering`` is readout-gated.

    Such a request never reads vLLM's prefix cache: the gate of its first computed position
    needs the gate readout of the position before it, which a cached block does not keep.
    """
    return any(entry.gate is not None for entry in steering)


def cache_salt(base: str | None, steering: Steering, prompt_len: int) -> str | None:
    """The ``cache_salt`` of a request with ``prompt_len`` prompt tokens; ``base`` is its unsteered salt."""
    prompt = digest(active(steering, 0, prompt_len))
    generated = digest(active(steering, prompt_len, prompt_len))
    if not prompt and not generated:
        return base
    scope: list[Any] = [base, prompt, generated]
    if prompt != generated:
        scope.append(prompt_len)
    return hashlib.sha256(json.dumps(scope).encode()).hexdigest()[:32]
