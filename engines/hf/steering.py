"""Steering inside the forward pass: vectors added to the residual stream after a decoder layer.

One hook per concept-pack layer, registered ahead of the readout hooks on the same layer, so
the readouts of that layer and of every later one see the steered stream. Before each forward
pass the step says which rows and which of their tokens each vector goes to (:meth:`Steerer.plan`);
the hook touches only those slices. A row nobody steers is never written, so an unsteered
request in a batch computes exactly what it computes alone. The add is done in float32 and
cast back to the model's dtype once per vector.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prismgate.core.errors import invalid
from prismgate.core.steering import Positions, Steering
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.readouts.probe import decoder_layers


@dataclass(frozen=True, slots=True, eq=False)  # equal only to itself: plans are cached by identity
class Vector:
    """A steering entry resolved against the pack: which hooked layer, and the unit vector on the device."""

    index: int  # position of the layer in the pack's layer list (one hook each)
    add: torch.Tensor  # [hidden], float32: scale * the unit direction
    norm_match: bool
    positions: Positions


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Row ``row`` of the next forward pass runs timeline positions ``[start, start + tokens)``."""

    row: int
    start: int
    tokens: int
    prompt_len: int
    vectors: tuple[Vector, ...]


class Steerer:
    def __init__(self, model: Any, pack: ConceptPack) -> None:
        layers = decoder_layers(model)
        param = next(model.parameters())
        self.pack = pack
        self._device = param.device
        directions = torch.from_numpy(pack.directions).to(device=param.device, dtype=torch.float32)
        self._directions = directions / directions.norm(dim=-1, keepdim=True)  # packs hold unit vectors; be sure
        self._plan: dict[int, list[Group]] = {}
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
            vectors.append(Vector(index, entry.scale * unit, entry.norm_match, entry.positions))
        return tuple(vectors)

    @contextlib.contextmanager
    def plan(self, rows: Sequence[RowPlan]) -> Iterator[None]:
        """Steer the next forward pass as ``rows`` say; nothing is steered outside the block."""
        waves = _waves(rows)
        # the key holds the vectors themselves, so none is freed and its identity reused while cached
        key = tuple((where, tuple(members)) for where, members in waves)
        if key != self._last[0]:
            self._last = (key, _groups(waves))
        self._plan = self._last[1]
        try:
            yield
        finally:
            self._plan = {}

    def _hook(self, index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            groups = self._plan.get(index)
            if not groups:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            for group in groups:
                h = hidden[group.rows, group.lo : group.hi].to(torch.float32)  # [k, tokens, hidden]
                add = group.add
                if group.norm_matched is not None:
                    add = add * torch.where(group.norm_matched, h.norm(dim=-1, keepdim=True), 1.0)
                hidden[group.rows, group.lo : group.hi] = (h + add).to(hidden.dtype)

        return hook

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
            lo, hi = _covered(vector.positions, r.start, r.tokens, r.prompt_len)
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
        group = Group(torch.tensor([row for row, _ in members], device=device), lo, hi, add, norm_matched)
        plan.setdefault(index, []).append(group)
    return plan


def _covered(positions: Positions, start: int, tokens: int, prompt_len: int) -> tuple[int, int]:
    """The tokens ``[lo, hi)`` of a row (positions ``start...``) that ``positions`` steers."""
    end = start + tokens
    if positions is Positions.BOTH:
        return 0, tokens
    split = min(max(prompt_len, start), end) - start  # tokens before the first generated position
    return (0, split) if positions is Positions.PROMPT else (split, tokens)
