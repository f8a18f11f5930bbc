"""A request's steering in the vLLM worker's terms, and the prefix-cache scope it needs.

The worker adds vectors from a table per steered layer (:mod:`.capture`): rows for the
pack's concepts, and :data:`RAW_SLOTS` rows for raw directions, which this side hands out
to requests in flight (:class:`RawSlots`) so that two requests never share a row. What a
request steers travels in ``SamplingParams.extra_args`` with the rest of what the worker
reads (:func:`.plan.wants`), as plain lists.

vLLM's prefix cache keys blocks by their tokens and the request's ``cache_salt``; it knows
nothing of steering. :func:`cache_salt` therefore folds the steering a request applies into
its salt: requests that steer their positions alike share blocks, requests that steer
differently (or not at all) never do, and unsteered requests keep the salt they always had.
vLLM also caches the blocks a request generates, under the same salt: that is exact when
the request steers its prompt and its generated tokens alike (the next turn sees those
tokens as prompt, steered the same way). When it steers them differently (``prompt`` or
``generated`` entries) the salt also names the prompt's length, so only a request with the
same prompt and spec ever reads those blocks.

Only the core is imported here: this module is also loaded inside vLLM's worker.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.steering import Comparison, Steering, active, digest

MAX_ROUNDS = 8  # the most vectors one request may add at one layer (``vllm_steering_rounds`` picks up to this)
RAW_SLOTS = 32  # table rows per steered layer for raw directions of requests in flight


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
) -> dict[str, Any] | None:
    """What the worker reads for ``steering`` (None: none); raw directions take slots under ``key``.

    ``rounds`` is how many vectors the worker's graph adds at one layer (``vllm_steering_rounds``).

    ``e`` lists the entries in order as ``[layer index, table row, scale, norm matched,
    positions value, gate]``, ``gate`` None or ``[layer index, concept index, above, threshold]``;
    ``raw`` the rows to fill as ``[layer index, table row, unit vector]``.
    """
    if not steering:
        return None
    per_layer: dict[int, int] = {}
    entries: list[list[Any]] = []
    raw: list[list[Any]] = []
    for entry in steering:
        if entry.layer not in layers:
            raise invalid(f"steering layer {entry.layer} is not a layer of the concept pack")
        index = layers.index(entry.layer)
        per_layer[index] = per_layer.get(index, 0) + 1
        if per_layer[index] > rounds:
            raise invalid(
                f"this server's vLLM engine adds at most {rounds} steering vectors at one layer "
                f"(vllm_steering_rounds); layer {entry.layer} has more"
            )
        if entry.concept is not None:
            if entry.concept not in concepts:
                raise invalid(f"unknown steering concept {entry.concept!r}")
            row = 1 + concepts.index(entry.concept)
        else:
            row = 1 + len(concepts) + slots.take(key, index)
            raw.append([index, row, list(entry.unit_direction())])
        gate: list[Any] | None = None
        if entry.gate is not None:
            g = entry.gate
            if g.layer not in layers or g.concept not in concepts:
                raise invalid(f"steering gate {g.concept!r} at layer {g.layer} is not a readout of the pack")
            above = int(g.comparison is Comparison.ABOVE)
            gate = [layers.index(g.layer), concepts.index(g.concept), above, g.threshold]
        entries.append([index, row, float(entry.scale), int(entry.norm_match), entry.positions.value, gate])
    return {"n": prompt_len, "e": entries, "raw": raw}


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
