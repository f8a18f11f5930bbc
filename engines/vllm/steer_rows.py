"""The host half of in-graph steering: before each step, which row of the batch gets which vector.

The graph (:mod:`.capture`) reads, per steered layer, a vector index, a scale and a
norm-matching flag for every row and round. This fills them from the requests' steering
(:func:`.steer.worker_steering`) and their rows' absolute positions, so a request preempted and
recomputed is steered exactly as the first time. A step laid out as the one before (every
decode step of a steady batch) writes nothing: the buffers already say what it needs. Gated
entries also get their rows' previous readouts, carried between steps (:meth:`SteerWriter.carry`,
NaN, a closed gate, at position 0), so a step with a gated request is written in full. Clamps
and feature gates go to the SAE layer's buffers (:mod:`.sae_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prismgate.core.steering import Positions
from prismgate.engines.sae.encode import decoder_direction
from prismgate.engines.vllm.sae_rows import FeaturePlan

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
        return Positions.PROMPT.span(self.start, self.rows, int(self.steering["n"]))[1]


class SteerWriter:
    """Writes the steering buffers of this worker's layers.

    ``slots`` are the pack's indices of those layers (None: all of them): with pipeline
    parallelism a stage holds some of the pack's layers and steers only at those; the
    entries of a request name layers by their pack index.
    """

    def __init__(self, buffers: list[SteerBuffers], slots: list[int] | None = None) -> None:
        self.buffers = buffers
        self.width = int(buffers[0].index.shape[1])  # rounds per layer the graph makes room for
        self.step = 0
        # request -> (the step it last ran in, the position of its last row, [layers, concepts] there)
        self._carried: dict[str, tuple[int, int, np.ndarray]] = {}
        self._local = {slot: i for i, slot in enumerate(slots if slots is not None else range(len(buffers)))}
        self._dirty = [0] * len(buffers)  # rows of each layer the last step wrote (to clear)
        self._clamped = [0] * len(buffers)  # rows of each SAE layer whose clamp buffers the last step wrote
        self._raw: dict[tuple[int, int], str] = {}  # (layer, table row) -> the request whose vector is there
        self._layout: tuple[Any, ...] = ()  # what the buffers hold now, as _layout() names it
        self._gates_last = False  # whether the last step written had gates (their flags to clear)

    def plan(self, requests: list[SteeredRows], n_rows: int) -> None:
        """Fill the buffers for a step of ``n_rows`` rows in which ``requests`` steer."""
        self.step += 1
        if self._gates_last:  # a replayed CUDA graph reads the gates whatever the flags say: clear them
            for buffer in self.buffers:
                buffer.rounds[2:5] = 0  # readout reads, gated rounds, feature reads
                buffer.gate.fill_(-1)
            self._gates_last = False
        if not requests and not any(self._dirty):
            return
        layout = _layout(requests, n_rows)
        gates_now = any(_gated(req) for req in requests)
        if layout == self._layout and not gates_now:
            return
        self._layout = () if gates_now else layout
        n_layers = len(self.buffers)
        width = self.width
        index = np.zeros((n_layers, n_rows, width), dtype=np.int64)
        scale = np.zeros((n_layers, n_rows, width), dtype=np.float32)
        normed = np.zeros((n_layers, n_rows, width), dtype=np.bool_)
        gates = _Gates(n_layers, n_rows, width) if gates_now else None
        features = FeaturePlan(n_layers, n_rows, width, self.buffers[0].reads.n_concepts)
        rounds = [0] * n_layers
        for req in requests:
            self._fill_raw(req)
            used = [0] * n_layers
            for slot, row, value, norm_match, positions, gate, *rest in req.steering["e"]:
                clamp = rest[0] if rest else None
                layer = self._local.get(slot)
                if layer is None:  # another pipeline stage's layer
                    continue
                k = used[layer]
                used[layer] += 1
                if gate is not None:  # read even where it steers no row: the request's next step needs it
                    assert gates is not None
                    gates.read(gate[0], self._local, concept=len(gate) <= 4)
                    if len(gate) > 4:  # a gate on an SAE feature: its layer encodes every row of the request
                        features.gate(self._local[gate[0]], req.lo, req.rows, gate[1], gate[4])
                lo, hi = Positions(positions).span(req.start, req.rows, int(req.steering["n"]))
                if hi <= lo:
                    continue
                rows = np.arange(req.lo + lo, req.lo + hi)
                index[layer, rows, k] = row
                scale[layer, rows, k] = value
                normed[layer, rows, k] = bool(norm_match)
                rounds[layer] = max(rounds[layer], k + 1)
                if clamp is not None:
                    features.clamp(layer, k, rows, clamp[0], clamp[1])
                if gate is not None:
                    assert gates is not None
                    gates.add(layer, k, rows, req, gate, self._carried_before(req))
        for layer, buffer in enumerate(self.buffers):
            stale = self._dirty[layer]
            if gates is not None:
                gates.write(layer, buffer)
            if buffer.sae is not None:
                self._clamped[layer] = features.write(layer, buffer, self._clamped[layer])
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
        if gates is not None:
            self.buffers[0].reads.prev[:n_rows].copy_(torch.from_numpy(gates.prev_rows(requests, n_rows)))
        self._gates_last = gates is not None

    def carry(self, requests: list[SteeredRows]) -> None:
        """After a step: keep each gated request's gate readouts at its last row, for its next step."""
        gated = [req for req in requests if _gated(req)]
        if gated:
            last = torch.tensor([req.lo + req.rows - 1 for req in gated], dtype=torch.int64)
            pre = self.buffers[0].reads.pre
            values = pre.index_select(1, last.to(pre.device)).to("cpu").numpy()  # [layers, requests, concepts]
            for j, req in enumerate(gated):
                self._carried[req.key] = (self.step, req.start + req.rows - 1, values[:, j].copy())
        # a request that has not run for a while has finished (or restarts from position 0)
        for key in [k for k, (step, _, _) in self._carried.items() if step < self.step - CARRY_STEPS]:
            del self._carried[key]

    def _carried_before(self, req: SteeredRows) -> np.ndarray | None:
        """The gate readouts of the position before ``req``'s first row in this step, if known."""
        held = self._carried.get(req.key)
        if held is None or held[1] != req.start - 1:
            return None
        return held[2]

    def _fill_raw(self, req: SteeredRows) -> None:
        """Put the request's raw directions, and its features' unit decoder rows, into its table rows."""
        for slot, row, vector in req.steering.get("raw", ()):
            layer = self._local.get(slot)
            if layer is not None and self._raw.get((layer, row)) != req.key:
                self.buffers[layer].table[row].copy_(torch.tensor(vector, dtype=torch.float32))
                self._raw[(layer, row)] = req.key
        for slot, row, feature in req.steering.get("dec", ()):
            layer = self._local.get(slot)
            if layer is not None and self._raw.get((layer, row)) != req.key:
                sae = self.buffers[layer].sae
                if sae is None:  # the engine names only SAE layers; a worker without that SAE must not guess
                    raise ValueError(f"steering by feature {feature} at a layer this worker has no SAE for")
                self.buffers[layer].table[row].copy_(decoder_direction(sae.weights.W_dec, int(feature)))
                self._raw[(layer, row)] = req.key


CARRY_STEPS = 256  # steps a request's carried gate readouts outlive its last step


class _Gates:
    """One step's gate inputs, built on the host and written to every layer's buffers at once."""

    def __init__(self, n_layers: int, n_rows: int, width: int) -> None:
        self.gate = np.full((n_layers, n_rows, width, 2), -1, dtype=np.int64)
        self.threshold = np.zeros((n_layers, n_rows, width), dtype=np.float32)
        self.above = np.zeros((n_layers, n_rows, width), dtype=np.bool_)
        self.carried = np.full((n_layers, n_rows, width), np.nan, dtype=np.float32)
        self.reads = np.zeros(n_layers, dtype=np.bool_)  # layers a gate reads
        self.gated = np.zeros(n_layers, dtype=np.bool_)  # layers with a gated round
        self.local: dict[int, int] = {}  # pack slot -> this worker's layer, for the slots gates read

    def read(self, slot: int, local: dict[int, int], *, concept: bool = True) -> None:
        """Have the layer of slot ``slot`` write its gate values before its vectors (a gate reads them).

        A concept gate's layer writes its readouts; a feature gate's also its features' activations,
        which :meth:`.sae_rows.FeaturePlan.gate` names.
        """
        source = local.get(slot)
        if source is None:  # the engine refuses gates under pipeline parallelism
            raise ValueError(f"the gate of a steering entry reads steering layer {slot}, which this stage lacks")
        self.reads[source] |= concept
        self.local[slot] = source

    def add(
        self, layer: int, k: int, rows: np.ndarray, req: SteeredRows, gate: list[Any], carried: np.ndarray | None
    ) -> None:
        """Gate round ``k`` of ``layer`` at ``rows`` of ``req`` (the gate's slot already :meth:`read`).

        ``gate[1]`` is the column of the gate value: a concept's readout, or (past the concepts) a
        feature activation; both are carried between steps the same way."""
        slot, column, above, threshold = gate[:4]
        source = self.local[slot]
        self.gate[layer, rows, k] = (source, column)
        self.threshold[layer, rows, k] = threshold
        self.above[layer, rows, k] = bool(above)
        if carried is not None:
            self.carried[layer, req.lo, k] = carried[source, column]
        self.gated[layer] = True

    def write(self, layer: int, buffer: SteerBuffers) -> None:
        n_rows = self.gate.shape[1]
        buffer.gate[:n_rows].copy_(torch.from_numpy(self.gate[layer]))
        buffer.threshold[:n_rows].copy_(torch.from_numpy(self.threshold[layer]))
        buffer.above[:n_rows].copy_(torch.from_numpy(self.above[layer]))
        buffer.carried[:n_rows].copy_(torch.from_numpy(self.carried[layer]))
        buffer.rounds[2] = int(self.reads[layer])
        buffer.rounds[3] = int(self.gated[layer])

    @staticmethod
    def prev_rows(requests: list[SteeredRows], n_rows: int) -> np.ndarray:
        """Each row's previous position's row in this pass: the row before it, -1 for a request's first."""
        prev = np.arange(-1, n_rows - 1, dtype=np.int64)
        for req in requests:
            prev[req.lo] = -1
        return prev


def _gated(req: SteeredRows) -> bool:
    return any(entry[5] is not None for entry in req.steering["e"])


def _layout(requests: list[SteeredRows], n_rows: int) -> tuple[Any, ...]:
    """What decides the buffers' contents: each request's rows, and how many lie in its prompt."""
    return (n_rows, *((r.key, r.lo, r.rows, r.in_prompt) for r in requests))
