"""The ``steering`` list as JSON, the one spelling OpenAI, GraphPipe and Evergreen's Struct share.

``[{"concept": "french", "layer": 16, "scale": 8, "norm_match": false, "positions": "both"}, ...]``,
or ``"direction": [numbers]`` or ``"feature": id`` (an SAE feature) instead of ``"concept"``; a
feature entry may take ``"clamp": value`` instead of ``"scale"``; and optionally
``"gate": {"concept": "french", "layer": 12, "comparison": "above", "threshold": 0.5}`` (or
``"feature": id`` instead of the gate's ``"concept"``).
The count is checked against the request budget before any entry is read; what the entries
mean (known concepts and layers, the scale's range) the core checks
(:mod:`prismgate.core.steering`, :mod:`prismgate.core.checks`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from prismgate.core.budget import RequestBudget
from prismgate.core.errors import GatewayError, invalid
from prismgate.core.steering import Comparison, Gate, Positions, Steering, SteeringEntry

KEYS = ("concept", "direction", "feature", "layer", "scale", "clamp", "norm_match", "positions", "gate")
GATE_KEYS = ("concept", "feature", "layer", "comparison", "threshold")


def read_steering(value: Any, budget: RequestBudget, where: str = "steering") -> Steering:
    """A JSON list of steering entries (None or absent: no steering)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(f"{where} must be a list of steering entries, got {_kind(value)}")
    budget.check_lists(steering_entries=len(value))
    return tuple(_entry(item, f"{where}[{i}]", budget) for i, item in enumerate(value))


def _entry(item: Any, where: str, budget: RequestBudget) -> SteeringEntry:
    item = _object(item, where, KEYS)
    layer = _layer(item, where)
    if ("scale" in item) == ("clamp" in item):
        raise invalid(f"{where} takes a scale or (with a feature) a clamp, exactly one of the two")
    scale = _number(item, where, "scale") if "scale" in item else 0.0
    clamp = _number(item, where, "clamp") if "clamp" in item else None
    feature = _feature(item, where)
    concept = item.get("concept")
    if concept is not None and not isinstance(concept, str):
        raise invalid(f"{where}.concept must be a string, got {_kind(concept)}")
    direction = item.get("direction")
    if direction is not None:
        if isinstance(direction, list):
            budget.check_direction(len(direction), f"{where}.direction")
        if not isinstance(direction, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in direction
        ):
            raise invalid(f"{where}.direction must be a list of numbers")
        direction = tuple(_float(x) for x in direction)
    norm_match = item.get("norm_match", False)
    if not isinstance(norm_match, bool):
        raise invalid(f"{where}.norm_match must be true or false, got {_kind(norm_match)}")
    positions = item.get("positions", Positions.BOTH.value)
    choices = [p.value for p in Positions]
    if positions not in choices:
        raise invalid(f"{where}.positions must be one of {', '.join(choices)}, got {_kind(positions)}")
    gate = item.get("gate")
    try:
        return SteeringEntry(
            layer=layer,
            scale=_float(scale),
            concept=concept,
            direction=direction,
            norm_match=norm_match,
            positions=Positions(positions),
            gate=_gate(gate, f"{where}.gate") if gate is not None else None,
            feature=feature,
            clamp=_float(clamp) if clamp is not None else None,
        )
    except GatewayError as exc:
        raise invalid(f"{where}: {exc.message}") from None


def _gate(item: Any, where: str) -> Gate:
    item = _object(item, where, GATE_KEYS)
    concept = item.get("concept")
    feature = _feature(item, where)
    if feature is not None and concept is not None:
        raise invalid(f"{where} names a concept or a feature, not both")
    if feature is None and not isinstance(concept, str):
        raise invalid(f"{where}.concept must be a string (a concept of the pack), got {_kind(concept)}")
    layer = _layer(item, where)
    threshold = _number(item, where, "threshold")
    comparison = item.get("comparison")
    choices = [c.value for c in Comparison]
    if comparison not in choices:
        raise invalid(f"{where}.comparison must be one of {', '.join(choices)}, got {_kind(comparison)}")
    try:
        return Gate(
            concept=concept,
            layer=layer,
            comparison=Comparison(comparison),
            threshold=_float(threshold),
            feature=feature,
        )
    except GatewayError as exc:
        raise invalid(f"{where}: {exc.message}") from None


def _object(item: Any, where: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``item`` as a JSON object holding no key but ``keys``."""
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object, got {_kind(item)}")
    unknown = sorted(set(item) - set(keys))
    if unknown:
        raise invalid(f"{where} has unknown keys {', '.join(map(repr, unknown))}; it takes {', '.join(keys)}")
    return item


def _layer(item: dict[str, Any], where: str) -> int:
    layer = item.get("layer")
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise invalid(f"{where}.layer must be an integer (a layer of the concept pack), got {_kind(layer)}")
    return layer


def _feature(item: dict[str, Any], where: str) -> int | None:
    """An SAE feature id, or None when the object names none (its range the core checks against the SAE)."""
    feature = item.get("feature")
    if feature is not None and (isinstance(feature, bool) or not isinstance(feature, int)):
        raise invalid(f"{where}.feature must be an integer (an SAE feature id), got {_kind(feature)}")
    if feature is not None and not 0 <= feature < 2**31:
        raise invalid(f"{where}.feature must be in [0, 2^31), got {feature}")
    return feature


def _number(item: dict[str, Any], where: str, key: str) -> int | float:
    value = item.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"{where}.{key} must be a number, got {_kind(value)}")
    return value


def _float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past float range: out of every scale's range
        return math.inf


def _kind(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool) or value is None else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def entry_from_message(
    message: Any, positions: Positions, comparison: Comparison | None, where: str, budget: RequestBudget
) -> SteeringEntry:
    """A steering entry from a protobuf message with the core's field names (Evergreen's config, Salience's companion).

    ``positions`` and the gate's ``comparison`` come decoded: each wire spells them its own way
    (a string, an enum); ``comparison`` is None when the message has no gate. The direction's
    length is checked before its numbers are copied out of the message.
    """
    budget.check_direction(len(message.direction), f"{where}.direction")
    try:
        gate = None
        if comparison is not None:
            g = message.gate
            try:
                gate = Gate(
                    concept=g.concept or None,
                    layer=g.layer,
                    comparison=comparison,
                    threshold=g.threshold,
                    feature=g.feature if g.HasField("feature") else None,
                )
            except GatewayError as exc:
                raise invalid(f"gate: {exc.message}") from None
        clamp = message.clamp if message.HasField("clamp") else None
        if clamp is not None and message.scale != 0:
            raise invalid("a steering entry has a scale or a clamp, not both")
        return SteeringEntry(
            layer=message.layer,
            scale=message.scale,
            concept=message.concept or None,
            direction=tuple(message.direction) or None,
            norm_match=message.norm_match,
            positions=positions,
            gate=gate,
            feature=message.feature if message.HasField("feature") else None,
            clamp=clamp,
        )
    except GatewayError as exc:
        raise invalid(f"{where}: {exc.message}") from None
