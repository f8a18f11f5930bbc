"""Steering inside the forward pass: vectors added to the residual stream after a decoder layer.

One hook per concept-pack layer and per SAE layer, registered ahead of the readout hooks on the
same layer, so the readouts of that layer and of every later one see the steered stream. Before
each pass the step says which rows and tokens each vector goes to (:meth:`Steerer.plan`); a row
nobody steers is never written, so an unsteered request in a batch computes exactly what it
computes alone. Adds are float32, cast back once per vector. A gated vector goes in at a token
only while its gate readout one position earlier passes (the gate layer's hook reads it before
adding its own vectors; a row's first token uses the value its request carried,
:attr:`RowPlan.before`). SAE features steer as vectors (unit decoder rows), clamps and feature
gates by encoding the stream with the row-invariant products (:class:`~prismgate.engines.sae.encode.SaeEncoder`),
so a row gets the same bits whatever else runs in its batch. The rules: docs/steering.md.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from prismgate.core.errors import invalid
from prismgate.core.steering import Comparison, Gate, Positions, Steering, SteeringEntry
from prismgate.engines.introspect import decoder_layers
from prismgate.engines.invariant_rows import SWITCH
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.sae.encode import SaeEncoder, decoder_direction

# (kind, layer, index): a concept readout ("concept", layer, concept index in the pack) or an SAE
# feature's activation ("feature", layer, feature id)
GateKey = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class GateRef:
    """A gate resolved against the pack: which readout it compares, and how."""

    key: GateKey
    above: bool
    threshold: float

    def open(self, previous: torch.Tensor) -> torch.Tensor:
        """Where the gate is open, given the readout one position earlier (NaN: no earlier position, closed)."""
        return previous > self.threshold if self.above else previous < self.threshold


@dataclass(frozen=True, slots=True, eq=False)
class ClampRef:
    """A clamp resolved against the SAE: set ``feature``'s activation to ``target`` with its raw decoder row."""

    feature: int
    target: float
    row: torch.Tensor  # [hidden], float32: W_dec[feature]


@dataclass(frozen=True, slots=True, eq=False)  # equal only to itself: plans are cached by identity
class Vector:
    """A steering entry resolved against the pack or SAE: which hooked layer, and the vector on the device."""

    layer: int  # the decoder layer whose output it is added to (one hook each)
    add: torch.Tensor  # [hidden], float32: scale * the unit direction (zeros for a clamp)
    norm_match: bool
    positions: Positions
    gate: GateRef | None = None
    clamp: ClampRef | None = None


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
    def __init__(
        self,
        model: Any,
        pack: ConceptPack | None,
        project: Callable[[int, torch.Tensor], torch.Tensor] | None,
        encoders: Sequence[SaeEncoder] = (),
    ) -> None:
        """``project(index, hidden)``: the readouts of ``hidden`` at the pack's ``index``-th layer (the probe's);
        ``encoders``: the SAEs, whose layers are hooked too (for feature entries, clamps and feature gates)."""
        layers = decoder_layers(model)
        param = next(model.parameters())
        self.pack = pack
        self.encoders = {e.layer: e for e in encoders}
        self._device = param.device
        self._directions: torch.Tensor | None = None
        if pack is not None:
            directions = torch.from_numpy(pack.directions).to(device=param.device, dtype=torch.float32)
            self._directions = directions / directions.norm(dim=-1, keepdim=True)  # packs hold unit vectors; be sure
        self._project = project  # the readout probe's: what a gate compares is exactly a readout
        self.layers = tuple(sorted({*(pack.layers if pack is not None else ()), *self.encoders}))
        self._plan: dict[int, list[Group]] = {}
        self._reads: dict[int, list[GateKey]] = {}  # layer -> the gate readouts taken there in this pass
        self._before: dict[int, Mapping[GateKey, float]] = {}  # row -> its gate readouts one position back
        self._values: dict[GateKey, torch.Tensor] = {}  # [batch, tokens] per gate readout, filled by the hooks
        self._last: tuple[Any, dict[int, list[Group]]] = ((), {})  # a batch steers alike step after step
        self._handles = [layers[layer].register_forward_hook(self._hook(layer), prepend=True) for layer in self.layers]

    def resolve(self, steering: Steering) -> tuple[Vector, ...]:
        """The request's entries as vectors on the device (the core has checked them against the manifest)."""
        return tuple(self._vector(entry) for entry in steering)

    def _vector(self, entry: SteeringEntry) -> Vector:
        if entry.layer not in self.layers:
            raise invalid(f"steering layer {entry.layer} is not a layer of the concept pack or of an SAE")
        clamp = None
        if entry.feature is not None:
            W_dec = self._encoder(entry.layer, entry.feature).W_dec
            if entry.clamp is not None:
                clamp = ClampRef(entry.feature, entry.clamp, W_dec[entry.feature])
                unit = torch.zeros_like(W_dec[entry.feature])
            else:  # normalised exactly as a raw direction is: a feature and its row as a direction add the same bits
                unit = decoder_direction(W_dec, entry.feature)
        elif entry.concept is not None:
            if self.pack is None or self._directions is None or entry.layer not in self.pack.layers:
                raise invalid(f"steering layer {entry.layer} is not a layer of the concept pack")
            if entry.concept not in self.pack.concepts:
                raise invalid(f"unknown steering concept {entry.concept!r}")
            unit = self._directions[self.pack.layers.index(entry.layer), self.pack.concepts.index(entry.concept)]
        else:
            unit = self._tensor(entry.unit_direction())
        gate = None
        if entry.gate is not None:
            g = entry.gate
            gate = GateRef(self._gate_key(g), g.comparison is Comparison.ABOVE, g.threshold)
        return Vector(entry.layer, entry.scale * unit, entry.norm_match, entry.positions, gate, clamp)

    def _tensor(self, values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self._device)

    def _encoder(self, layer: int, feature: int) -> SaeEncoder:
        encoder = self.encoders.get(layer)
        if encoder is None or not 0 <= feature < encoder.sae.d_sae:
            raise invalid(f"steering feature {feature} at layer {layer} is not a feature of an SAE of this model")
        return encoder

    def _gate_key(self, g: Gate) -> GateKey:
        if g.feature is not None:
            self._encoder(g.layer, g.feature)
            return ("feature", g.layer, g.feature)
        if self.pack is None or g.layer not in self.pack.layers or g.concept not in self.pack.concepts:
            raise invalid(f"steering gate {g.concept!r} at layer {g.layer} is not a readout of the pack")
        return ("concept", g.layer, self.pack.concepts.index(g.concept))

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
        reads: dict[int, set[GateKey]] = {}
        for r in rows:
            for v in r.vectors:
                if v.gate is not None:
                    reads.setdefault(v.gate.key[1], set()).add(v.gate.key)
        self._reads = {layer: sorted(keys) for layer, keys in reads.items()}
        self._before = {r.row: r.before for r in rows}
        values: dict[GateKey, torch.Tensor] = {}
        self._values = values
        try:
            yield values
        finally:
            self._plan, self._reads, self._before, self._values = {}, {}, {}, {}

    def _hook(self, layer: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            keys = self._reads.get(layer)
            if keys:  # before this layer's vectors: a gate here serves vectors here too
                self._read_gates(layer, hidden, keys)
            for group in self._plan.get(layer, ()):
                h = hidden[group.rows, group.lo : group.hi].to(torch.float32)  # [k, tokens, hidden]
                add = group.add
                if group.norm_matched is not None:
                    add = add * torch.where(group.norm_matched, h.norm(dim=-1, keepdim=True), 1.0)
                if group.clamp is not None:
                    add = group.clamp.add(self.encoders[layer], h, add)
                steered = h + add
                if group.gates is not None:
                    steered = torch.where(self._open(group), steered, h)
                hidden[group.rows, group.lo : group.hi] = steered.to(hidden.dtype)

        return hook

    def _read_gates(self, layer: int, hidden: torch.Tensor, keys: Sequence[GateKey]) -> None:
        """Take the readouts and feature activations this layer's gates compare, ``[batch, tokens]`` each."""
        if any(kind == "concept" for kind, _, _ in keys):
            assert self._project is not None and self.pack is not None
            readouts = self._project(self.pack.layers.index(layer), hidden)  # [batch, tokens, concepts]
            for kind, _, c in keys:
                if kind == "concept":
                    self._values[(kind, layer, c)] = readouts[..., c]
        if any(kind == "feature" for kind, _, _ in keys):
            with SWITCH.on():
                acts = self.encoders[layer].encode(hidden)  # [batch, tokens, d_sae]
            for kind, _, f in keys:
                if kind == "feature":
                    self._values[(kind, layer, f)] = acts[..., f]

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
    clamp: Clamps | None = None  # the members that clamp a feature; None: none does


@dataclass(frozen=True, slots=True, eq=False)
class Clamps:
    """The clamps of a group's members: ``(target - activation) * W_dec[f]`` in place of their vector."""

    clamped: torch.Tensor  # [k, 1, 1] bool: the member clamps
    features: torch.Tensor  # [k] int64: its feature (0 for a member that does not clamp)
    targets: torch.Tensor  # [k, 1, 1] float32
    rows: torch.Tensor  # [k, 1, hidden] float32: the raw decoder rows (zeros for a member that does not clamp)

    @classmethod
    def of(cls, vectors: Sequence[Vector]) -> Clamps | None:
        if all(v.clamp is None for v in vectors):
            return None
        device = vectors[0].add.device
        return cls(
            clamped=torch.tensor([v.clamp is not None for v in vectors], device=device).view(-1, 1, 1),
            features=torch.tensor([v.clamp.feature if v.clamp else 0 for v in vectors], device=device),
            targets=torch.tensor(
                [v.clamp.target if v.clamp else 0.0 for v in vectors], dtype=torch.float32, device=device
            ).view(-1, 1, 1),
            rows=torch.stack([v.clamp.row if v.clamp else torch.zeros_like(v.add) for v in vectors]).unsqueeze(1),
        )

    def add(self, encoder: SaeEncoder, h: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """``add`` with each clamping member's share replaced by what moves its feature to the target in ``h``."""
        with SWITCH.on():  # row-invariant products: a row's activations whatever else it is encoded with
            acts = encoder.encode(h)  # [k, tokens, d_sae]
        index = self.features.view(-1, 1, 1).expand(-1, h.shape[1], 1)
        activation = acts.gather(-1, index)  # [k, tokens, 1]
        return torch.where(self.clamped, (self.targets - activation) * self.rows, add)


Wave = tuple[tuple[int, int, int, int], list[tuple[int, Vector]]]  # (layer, round, lo, hi), members


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
            wave = seen[vector.layer] = seen.get(vector.layer, -1) + 1
            waves.setdefault((vector.layer, wave, lo, hi), []).append((r.row, vector))
    return sorted(waves.items(), key=lambda item: item[0][1])


def _groups(waves: list[Wave]) -> dict[int, list[Group]]:
    """The work of each hooked layer: one indexed write per wave."""
    plan: dict[int, list[Group]] = {}
    for (layer, _wave, lo, hi), members in waves:
        device = members[0][1].add.device
        add = torch.stack([v.add for _, v in members]).unsqueeze(1)
        norm_matched = None
        if any(v.norm_match for _, v in members):
            norm_matched = torch.tensor([v.norm_match for _, v in members], device=device).view(-1, 1, 1)
        row_ids = tuple(row for row, _ in members)
        gates = tuple(v.gate for _, v in members) if any(v.gate is not None for _, v in members) else None
        clamp = Clamps.of([v for _, v in members])
        group = Group(torch.tensor(row_ids, device=device), lo, hi, add, norm_matched, row_ids, gates, clamp)
        plan.setdefault(layer, []).append(group)
    return plan
