"""Concept steering: what a request adds to the residual stream, and where.

A steering entry adds ``scale * direction`` (a pack concept, a raw vector normalised here, or an
SAE feature's decoder row) to the stream after decoder layer ``layer`` at the positions it names,
optionally clamped (SAE features) or gated on a readout of the previous position (:class:`Gate`).
This module holds the rules every engine applies: the ranges (:data:`MAX_SCALE`,
:data:`MAX_NORM_MATCHED_SCALE`: wide enough to push a model off its usual text, narrow enough to
refuse a typo), and which cached positions were computed under the same steering
(:func:`spans`, :func:`agreed_prefix`), so a result never depends on what a cache holds. What
each field means is docs/steering.md.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prismgate.core.errors import invalid

MAX_SCALE = 256.0  # |scale| of an entry without norm matching: the length added, in residual units
MAX_NORM_MATCHED_SCALE = 4.0  # |scale| with norm matching: a multiple of the hidden state's norm
# |clamp|: a feature's activation, in the SAE's units. The embedded model's SAE has activations up to
# about 35 on ordinary tokens (thousands only at the attention sink, position 0).
MAX_CLAMP = 1000.0


class Comparison(enum.Enum):
    ABOVE = "above"
    BELOW = "below"


@dataclass(frozen=True, slots=True)
class Gate:
    """Open at a position while ``concept``'s readout (or SAE ``feature``'s activation) at ``layer``,
    one position earlier, is past ``threshold``."""

    concept: str | None
    layer: int
    comparison: Comparison
    threshold: float
    feature: int | None = None

    def __post_init__(self) -> None:
        if self.feature is None and not self.concept:
            raise invalid("a steering gate names a concept of the pack (or an SAE feature)")
        if self.feature is not None and self.concept:
            raise invalid("a steering gate names a concept or a feature, not both")
        if self.feature is not None and self.feature < 0:
            raise invalid(f"steering gate feature must be >= 0, got {self.feature}")
        if self.layer < 0:
            raise invalid(f"steering gate layer must be >= 0, got {self.layer}")
        if not math.isfinite(self.threshold):
            raise invalid(f"steering gate threshold must be a finite number, got {self.threshold}")

    def canonical(self) -> list[object]:
        """The gate as JSON: a concept gate keeps the form it had before feature gates existed."""
        if self.feature is None:
            return [self.concept, self.layer, self.comparison.value, self.threshold]
        return [None, self.layer, self.comparison.value, self.threshold, self.feature]

    @classmethod
    def from_canonical(cls, row: Sequence[Any]) -> Gate:
        feature = row[4] if len(row) > 4 else None
        return cls(row[0], row[1], Comparison(row[2]), row[3], feature)


class Positions(enum.Enum):
    PROMPT = "prompt"
    GENERATED = "generated"
    BOTH = "both"

    def span(self, start: int, tokens: int, prompt_len: int) -> tuple[int, int]:
        """Which of ``tokens`` positions from ``start`` these cover, as offsets ``[lo, hi)``.

        The one statement of the rule: every engine asks it for the rows of a forward pass
        (a prompt chunk, a decode step). A request's prompt positions come before its
        generated ones, so the covered positions of any run are one contiguous span.
        """
        if self is Positions.BOTH:
            return 0, tokens
        split = min(max(prompt_len - start, 0), tokens)  # how many of the run lie in the prompt
        return (0, split) if self is Positions.PROMPT else (split, tokens)

    def covers(self, position: int, prompt_len: int) -> bool:
        lo, hi = self.span(position, 1, prompt_len)
        return hi > lo


def effective(steering: Steering) -> Steering:
    """The entries that change anything: one of scale 0 adds nothing, so it is left out, and the
    forward pass is bit for bit the unsteered one (re-adding a zero can round a stream differently).
    A clamp always counts: it moves the feature wherever its activation is not already the target."""
    return tuple(entry for entry in steering if entry.scale != 0 or entry.clamp is not None)


def unit_vector(values: Sequence[float]) -> tuple[float, ...]:
    """``values`` at unit length, in float64: a raw direction's and a feature's decoder row alike.

    Scaled by its largest magnitude before squaring: the squares of ``1e-200`` underflow to zero
    and those of ``1e200`` overflow to infinity, yet both are fine directions.
    """
    largest = max(abs(x) for x in values)
    scaled = [x / largest for x in values]
    norm = math.sqrt(math.fsum(x * x for x in scaled))
    return tuple(x / norm for x in scaled)


@dataclass(frozen=True, slots=True)
class SteeringEntry:
    """One vector added at one layer: a pack concept by name, a raw ``direction``, or an SAE ``feature``.

    A feature entry has ``scale`` (its unit decoder row added) or ``clamp`` (its activation set;
    ``scale`` then stays 0), never both.
    """

    layer: int
    scale: float
    concept: str | None = None
    direction: tuple[float, ...] | None = None
    norm_match: bool = False
    positions: Positions = Positions.BOTH
    gate: Gate | None = None
    feature: int | None = None
    clamp: float | None = None

    def __post_init__(self) -> None:
        named = (self.concept is not None) + (self.direction is not None) + (self.feature is not None)
        if named != 1:
            if self.feature is None:
                raise invalid("a steering entry names a concept or carries a direction, exactly one of the two")
            raise invalid("a steering entry names a concept, a direction or a feature, exactly one of the three")
        if self.feature is not None and self.feature < 0:
            raise invalid(f"steering feature must be >= 0, got {self.feature}")
        if self.clamp is not None:
            if self.feature is None:
                raise invalid(
                    "clamp sets an SAE feature's activation: it goes with a feature, not a concept or direction"
                )
            if self.scale != 0:
                raise invalid("a steering entry has a scale or a clamp, not both")
            if self.norm_match:
                raise invalid("norm_match scales a vector's length; a clamp sets an activation and takes no norm_match")
            if not math.isfinite(self.clamp) or abs(self.clamp) > MAX_CLAMP:
                raise invalid(f"steering clamp must be in [-{MAX_CLAMP:g}, {MAX_CLAMP:g}], got {self.clamp}")
        if self.concept == "":
            raise invalid("a steering entry's concept must not be empty")
        if self.layer < 0:
            raise invalid(f"steering layer must be >= 0, got {self.layer}")
        limit = MAX_NORM_MATCHED_SCALE if self.norm_match else MAX_SCALE
        if not math.isfinite(self.scale) or abs(self.scale) > limit:
            kind = "with" if self.norm_match else "without"
            raise invalid(f"steering scale {kind} norm matching must be in [-{limit:g}, {limit:g}], got {self.scale}")
        if self.direction is not None:
            if not all(math.isfinite(x) for x in self.direction):
                raise invalid("a steering direction must hold finite numbers only")
            if not any(self.direction):
                raise invalid("a steering direction must not be all zeros")
        if self.gate is not None and self.gate.layer > self.layer:
            raise invalid(
                f"steering gate layer {self.gate.layer} comes after the steered layer {self.layer}; "
                "a gate reads a layer at or before the one it steers"
            )

    def unit_direction(self) -> tuple[float, ...]:
        """The raw direction at unit length (only for entries that carry one): :func:`unit_vector`."""
        assert self.direction is not None
        return unit_vector(self.direction)

    def canonical(self) -> list[Any]:
        """What the entry adds, as JSON (its positions aside): what :func:`digest` hashes.

        The gate and the feature part come only when set, so an entry without them keeps the
        form (and the digest) it had before they existed; a gate is a list, the feature part an
        object, so neither is ever read as the other.
        """
        row: list[Any] = [
            self.layer,
            self.scale,
            self.concept,
            list(self.direction) if self.direction is not None else None,
            self.norm_match,
        ]
        if self.gate is not None:
            row.append(self.gate.canonical())
        if self.feature is not None:
            row.append({"feature": self.feature, "clamp": self.clamp})
        return row


def to_json(entry: SteeringEntry) -> list[Any]:
    """An entry as a JSON row a session store keeps (:func:`from_json` reads it back)."""
    row = entry.canonical()
    return [*row[:5], entry.positions.value, *row[5:]]


def from_json(row: Sequence[Any]) -> SteeringEntry:
    layer, scale, concept, direction, norm_match, positions, *rest = row
    gate = next((Gate.from_canonical(x) for x in rest if isinstance(x, list)), None)
    extra = next((x for x in rest if isinstance(x, dict)), {})
    return SteeringEntry(
        layer=layer,
        scale=scale,
        concept=concept,
        direction=tuple(direction) if direction is not None else None,
        norm_match=norm_match,
        positions=Positions(positions),
        gate=gate,
        feature=extra.get("feature"),
        clamp=extra.get("clamp"),
    )


Steering = tuple[SteeringEntry, ...]


def active(steering: Steering, position: int, prompt_len: int) -> Steering:
    """The entries that steer ``position`` of a request whose prompt is ``prompt_len`` tokens."""
    return tuple(e for e in steering if e.positions.covers(position, prompt_len))


def digest(steering: Steering) -> str:
    """A short name for the steering of one position: equal digests, equal keys and values.

    The empty steering is ``""``; entry order counts (the vectors are added in order, and
    floating-point addition is not associative). A gated entry differs from the same entry
    ungated; an ungated entry keeps the digest it had before gates existed.
    """
    if not steering:
        return ""
    canonical = [e.canonical() for e in steering]
    return hashlib.sha256(json.dumps(canonical).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class SteeredSpan:
    """Positions ``[start, end)`` computed under the steering whose :func:`digest` is ``digest``."""

    start: int
    end: int
    digest: str


def spans(steering: Steering, prompt_len: int, end: int) -> tuple[SteeredSpan, ...]:
    """The steering of positions ``[0, end)`` of a request, as maximal runs of one digest.

    Unsteered runs are listed too (digest ``""``), so the spans always tile ``[0, end)``.
    """
    cuts = sorted({0, min(prompt_len, end), end})
    runs: list[SteeredSpan] = []
    for start, stop in itertools.pairwise(cuts):
        if stop <= start:
            continue
        d = digest(active(steering, start, prompt_len))
        if runs and runs[-1].digest == d:
            runs[-1] = SteeredSpan(runs[-1].start, stop, d)
        else:
            runs.append(SteeredSpan(start, stop, d))
    return tuple(runs)


def clip(record: Sequence[SteeredSpan], length: int) -> tuple[SteeredSpan, ...]:
    """The record of a timeline cut to its first ``length`` positions (truncate, fork)."""
    return tuple(SteeredSpan(s.start, min(s.end, length), s.digest) for s in record if s.start < length)


def agreed_prefix(a: Sequence[SteeredSpan], b: Sequence[SteeredSpan]) -> int:
    """How many leading positions ``a`` and ``b`` both cover with the same steering."""
    at = 0
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i].digest != b[j].digest:
            return at
        at = min(a[i].end, b[j].end)
        if a[i].end == at:
            i += 1
        if b[j].end == at:
            j += 1
    return at
