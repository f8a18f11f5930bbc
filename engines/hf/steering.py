"""Steering inside the forward pass: vectors added to the residual stream after a decoder layer.

One hook per concept-pack layer, registered ahead of the readout hooks on the same layer, so
the readouts of that layer and of every later one see the steered stream. Before each forward
pass the step says which rows and which of their tokens each vector goes to (:meth:`Steerer.plan`);
the hook touches only those slices. A row nobody steers is never written, so an unsteered
request in a batch computes exactly what it computes alone. The add is done in float32 and
cast back to the model's dtype once per vector.

A gated vector (:class:`prismgate.core.steering.Gate`) is added at a token only while its gate
readout one position earlier passes the threshold. The hook of the gate's layer takes that
readout (the projection the readouts use) of every token before adding its own layer's
vectors, so a later or the same layer can use it within the pass: token ``t`` of a row looks at
token ``t - 1``; a row's first token at the value its request carried from its previous pass
(:attr:`RowPlan.before`), or finds the gate closed when there is none (position 0).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from prismgate.core.errors import invalid
from prismgate.core.steering import Comparison, Positions, Steering
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.readouts.probe import decoder_layers

GateKey = tuple[int, int]  # (layer index in the pack, concept index): one gate readout


@dataclass(frozen=True, slots=True)
class GateRef:
    """A gate resolved against the pack: which readout it compares, and how."""

    key: GateKey
    above: bool
    threshold: float

    def open(self, previous: torch.Tensor) -> torch.Tensor:
        """Where the gate is open, given the readout one position earlier (NaN: no earlier position, closed)."""
        return previous > self.threshold if self.above else previous < self.threshold


@dataclass(frozen=True, slots=True, eq=False)  # equal only to itself: plans are cached by identity
class Vector:
    """A steering entry resolved against the pack: which hooked layer, and the unit vector on the device."""

    index: int  # position of the layer in the pack's layer list (one hook each)
    add: torch.Tensor  # [hidden], float32: scale * the unit direction
    norm_match: bool
    positions: Positions
    gate: GateRef | None = None


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Row ``row`` of the next forward pass runs timeline positions ``[start, start + tokens)``."""

    row: int
    start: int
    tokens: int
    prompt_len: int
    vectors: tuple[Vector, ...]
    before: Mapping[GateKey, float] = field(default_factory=dict)  # gate readouts at position start - 1


class Steerer:
    def __init__(self, model: Any, pack: ConceptPack, project: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """``project(index, hidden)``: the readouts of ``hidden`` at the pack's ``index``-th layer (the probe's)."""
        layers = decoder_layers(model)
        param = next(model.parameters())
        self.pack = pack
        self._device = param.device
        directions = torch.from_numpy(pack.directions).to(device=param.device, dtype=torch.float32)
        self._directions = directions / directions.norm(dim=-1, keepdim=True)  # packs hold unit vectors; be sure
        self._project = project  # the readout probe's: what a gate compares is exactly a readout
        self._plan: dict[int, list[Group]] = {}
        self._reads: dict[int, list[int]] = {}  # layer index -> the concepts gates read there in this pass
        self._before: dict[int, Mapping[GateKey, float]] = {}  # row -> its gate readouts one position back
        self._values: dict[GateKey, torch.Tensor] = {}  # [batch, tokens] per gate readout, filled by the hooks
        self._last: tuple[Any, dict[int, list[Group]]] = ((), {})  # a batch steers alike step after step
        self._handles = [
            layers[layer].register_forward_hook(self._hook(i), prepend=True) for i, layer in enumerate(pack.layers)
        ]

    def resolve(self, steering: Steering) -> tuple[Vector, ...]:
        """The request's entries as vectors on the device (the core has checked them against the manifest)."""
        vectors = []
        for entry in steering:
            if entry.layer not in self.pack.layers:
                raise invalid(f"steering layer {entry.layer} is not a layer of the concept pack")
            index = self.pack.layers.index(entry.layer)
            if entry.concept is not None:
                if entry.concept not in self.pack.concepts:
                    raise invalid(f"unknown steering concept {entry.concept!r}")
                unit = self._directions[index, self.pack.concepts.index(entry.concept)]
            else:
                unit = torch.tensor(entry.unit_direction(), dtype=torch.float32, device=self._device)
            gate = None
            if entry.gate is not None:
                g = entry.gate
                if g.layer not in self.pack.layers or g.concept not in self.pack.concepts:
                    raise invalid(f"steering gate {g.concept!r} at layer {g.layer} is not a readout of the pack")
                key = (self.pack.layers.index(g.layer), self.pack.concepts.index(g.concept))
                gate = GateRef(key, g.comparison is Comparison.ABOVE, g.threshold)
            vectors.append(Vector(index, entry.scale * unit, entry.norm_match, entry.positions, gate))
        return tuple(vectors)

    @contextlib.contextmanager
    def plan(self, rows: Sequence[RowPlan]) -> Iterator[Mapping[GateKey, torch.Tensor]]:
        """Steer the next forward pass as ``rows`` say; nothing is steered outside the block.

        The block gets the gate readouts the pass takes (``[batch, tokens]`` each), filled once
        the forward pass has run: a request carries its last one to its next pass.
        """
        waves = _waves(rows)
        # the key holds the vectors themselves, so none is freed and its identity reused while cached
        key = tuple((where, tuple(members)) for where, members in waves)
        if key != self._last[0]:
            self._last = (key, _groups(waves))
        self._plan = self._last[1]
        reads: dict[int, set[int]] = {}
        for r in rows:
            for v in r.vectors:
                if v.gate is not None:
                    reads.setdefault(v.gate.key[0], set()).add(v.gate.key[1])
        self._reads = {index: sorted(concepts) for index, concepts in reads.items()}
        self._before = {r.row: r.before for r in rows}
        values: dict[GateKey, torch.Tensor] = {}
        self._values = values
        try:
            yield values
        finally:
            self._plan, self._reads, self._before, self._values = {}, {}, {}, {}

    def _hook(self, index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            concepts = self._reads.get(index)
            if concepts:  # before this layer's vectors: a gate here serves vectors here too
                readouts = self._project(index, hidden)  # [batch, tokens, concepts]
                for c in concepts:
                    self._values[(index, c)] = readouts[..., c]
            for group in self._plan.get(index, ()):
                h = hidden[group.rows, group.lo : group.hi].to(torch.float32)  # [k, tokens, hidden]
                add = group.add
                if group.norm_matched is not None:
                    add = add * torch.where(group.norm_matched, h.norm(dim=-1, keepdim=True), 1.0)
                steered = h + add
                if group.gates is not None:
                    steered = torch.where(self._open(group), steered, h)
                hidden[group.rows, group.lo : group.hi] = steered.to(hidden.dtype)

        return hook

    def _open(self, group: Group) -> torch.Tensor:
        """``[k, tokens, 1]``: where each member's gate lets its vector in (always, for an ungated one)."""
        assert group.gates is not None
        masks = []
        for row, gate in zip(group.row_ids, group.gates, strict=True):
            if gate is None:
                masks.append(torch.ones(group.hi - group.lo, dtype=torch.bool, device=self._device))
                continue
            values = self._values[gate.key][row]  # [tokens]: this pass's readouts of the row
            carried = self._before.get(row, {}).get(gate.key, math.nan)
            first = torch.full((1,), carried, dtype=values.dtype, device=values.device)
            previous = torch.cat([first, values[:-1]])  # token t sees token t - 1
            masks.append(gate.open(previous[group.lo : group.hi]))
        return torch.stack(masks).unsqueeze(-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(frozen=True, slots=True)
class Group:
    """Vectors added at one layer to tokens ``[lo, hi)`` of several rows in one indexed write."""

    rows: torch.Tensor  # [k], distinct rows
    lo: int
    hi: int
    add: torch.Tensor  # [k, 1, hidden]: scale * unit
    norm_matched: torch.Tensor | None  # [k, 1, 1] bool: multiply by the hidden state's norm; None: none is
    row_ids: tuple[int, ...]  # ``rows`` on the host
    gates: tuple[GateRef | None, ...] | None  # each member's gate; None: no member is gated


Wave = tuple[tuple[int, int, int, int], list[tuple[int, Vector]]]  # (layer index, round, lo, hi), members


def _waves(rows: Sequence[RowPlan]) -> list[Wave]:
    """Who gets which vector: by layer, round and token range, rounds in order.

    A row with several vectors at one layer gets them one round after another, in its
    order (the second norm-matched vector sees the stream the first has changed).
    """
    waves: dict[tuple[int, int, int, int], list[tuple[int, Vector]]] = {}
    for r in rows:
        seen: dict[int, int] = {}
        for vector in r.vectors:
            lo, hi = vector.positions.span(r.start, r.tokens, r.prompt_len)
            if hi <= lo:
                continue
            wave = seen[vector.index] = seen.get(vector.index, -1) + 1
            waves.setdefault((vector.index, wave, lo, hi), []).append((r.row, vector))
    return sorted(waves.items(), key=lambda item: item[0][1])


def _groups(waves: list[Wave]) -> dict[int, list[Group]]:
    """The work of each hooked layer: one indexed write per wave."""
    plan: dict[int, list[Group]] = {}
    for (index, _wave, lo, hi), members in waves:
        device = members[0][1].add.device
        add = torch.stack([v.add for _, v in members]).unsqueeze(1)
        norm_matched = None
        if any(v.norm_match for _, v in members):
            norm_matched = torch.tensor([v.norm_match for _, v in members], device=device).view(-1, 1, 1)
        row_ids = tuple(row for row, _ in members)
        gates = tuple(v.gate for _, v in members) if any(v.gate is not None for _, v in members) else None
        group = Group(torch.tensor(row_ids, device=device), lo, hi, add, norm_matched, row_ids, gates)
        plan.setdefault(index, []).append(group)
    return plan
