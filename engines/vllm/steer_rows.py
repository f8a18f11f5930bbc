"""The host half of in-graph steering: before each step, which row of the batch gets which vector.

The graph (:mod:`.capture`) reads, per steered layer, an index into the layer's vector
table, a scale and a norm-matching flag for every row and round, and a round count in host
memory. This fills them from the requests' steering (:func:`.steer.worker_steering`) and
their rows' absolute positions: an entry steers a row when its ``positions`` cover the row's
position given the request's prompt length, so a request preempted and recomputed is
steered exactly as it was the first time. Entries at one layer take rounds in their order.

A step nobody steers after a step nobody steered writes nothing at all: every round count
is already 0, and the op returns before touching the stream. Nor does a step laid out as the
one before (the same requests on the same rows, as many of their rows in the prompt), which
is every decode step of a steady batch: the buffers already say what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prismgate.engines.vllm.steer import MAX_ROUNDS

if TYPE_CHECKING:
    from prismgate.engines.vllm.capture import SteerBuffers


@dataclass(frozen=True, slots=True)
class SteeredRows:
    """One request's rows in this step: flat rows ``[lo, lo + rows)`` at positions ``start...``."""

    key: str
    lo: int
    rows: int
    start: int
    steering: dict[str, Any]

    @property
    def in_prompt(self) -> int:
        """How many of the rows lie in the request's prompt (the rest are generated positions)."""
        return min(max(int(self.steering["n"]) - self.start, 0), self.rows)


class SteerWriter:
    """Writes the steering buffers of this worker's layers.

    ``slots`` are the pack's indices of those layers (None: all of them): with pipeline
    parallelism a stage holds some of the pack's layers and steers only at those; the
    entries of a request name layers by their pack index.
    """

    def __init__(self, buffers: list[SteerBuffers], slots: list[int] | None = None) -> None:
        self.buffers = buffers
        self._local = {slot: i for i, slot in enumerate(slots if slots is not None else range(len(buffers)))}
        self._dirty = [0] * len(buffers)  # rows of each layer the last step wrote (to clear)
        self._raw: dict[tuple[int, int], str] = {}  # (layer, table row) -> the request whose vector is there
        self._layout: tuple[Any, ...] = ()  # what the buffers hold now, as _layout() names it

    def plan(self, requests: list[SteeredRows], n_rows: int) -> None:
        """Fill the buffers for a step of ``n_rows`` rows in which ``requests`` steer."""
        if not requests and not any(self._dirty):
            return
        layout = _layout(requests, n_rows)
        if layout == self._layout:
            return
        self._layout = layout
        n_layers = len(self.buffers)
        index = np.zeros((n_layers, n_rows, MAX_ROUNDS), dtype=np.int64)
        scale = np.zeros((n_layers, n_rows, MAX_ROUNDS), dtype=np.float32)
        normed = np.zeros((n_layers, n_rows, MAX_ROUNDS), dtype=np.bool_)
        rounds = [0] * n_layers
        for req in requests:
            self._fill_raw(req)
            prompt = np.arange(req.rows) < req.in_prompt
            covers = (prompt, ~prompt, np.ones_like(prompt))
            used = [0] * n_layers
            for slot, row, value, norm_match, positions in req.steering["e"]:
                layer = self._local.get(slot)
                if layer is None:  # another pipeline stage's layer
                    continue
                k = used[layer]
                used[layer] += 1
                rows = req.lo + np.flatnonzero(covers[positions])
                if rows.size == 0:
                    continue
                index[layer, rows, k] = row
                scale[layer, rows, k] = value
                normed[layer, rows, k] = bool(norm_match)
                rounds[layer] = max(rounds[layer], k + 1)
        for layer, buffer in enumerate(self.buffers):
            stale = self._dirty[layer]
            if rounds[layer] == 0 and stale == 0:
                continue
            if rounds[layer]:
                buffer.index[:n_rows].copy_(torch.from_numpy(index[layer]))
                buffer.scale[:n_rows].copy_(torch.from_numpy(scale[layer]))
                buffer.normed[:n_rows].copy_(torch.from_numpy(normed[layer]))
                if stale > n_rows:
                    buffer.index[n_rows:stale].zero_()
                self._dirty[layer] = n_rows
            else:
                buffer.index[:stale].zero_()
                self._dirty[layer] = 0
            buffer.rounds[0] = rounds[layer]
            buffer.rounds[1] = int(rounds[layer] > 0 and bool(normed[layer].any()))

    def _fill_raw(self, req: SteeredRows) -> None:
        for slot, row, vector in req.steering.get("raw", ()):
            layer = self._local.get(slot)
            if layer is not None and self._raw.get((layer, row)) != req.key:
                table = self.buffers[layer].table
                table[row].copy_(torch.tensor(vector, dtype=torch.float32))
                self._raw[(layer, row)] = req.key


def _layout(requests: list[SteeredRows], n_rows: int) -> tuple[Any, ...]:
    """What decides the buffers' contents: each request's rows, and how many lie in its prompt."""
    return (n_rows, *((r.key, r.lo, r.rows, r.in_prompt) for r in requests))
