"""Readout-gated steering entries: the spec's own rules, the checks against a model, identity."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any

import pytest

from prismgate.codecs.steering import read_steering
from prismgate.core import checks
from prismgate.core.budget import RequestBudget
from prismgate.core.errors import Code, GatewayError
from prismgate.core.steering import Comparison, Gate, SteeringEntry, digest, spans

PLAIN = SteeringEntry(layer=1, scale=4.0, concept="concept1")
GATE = Gate(concept="concept0", layer=0, comparison=Comparison.ABOVE, threshold=0.25)
GATED = replace(PLAIN, gate=GATE)


def test_a_gate_checks_what_it_can_alone() -> None:
    for make, message in [
        (lambda: Gate("", 0, Comparison.ABOVE, 0.0), "names a concept"),
        (lambda: Gate("a", -1, Comparison.ABOVE, 0.0), "gate layer must be >= 0, got -1"),
        (lambda: Gate("a", 0, Comparison.BELOW, float("inf")), "threshold must be a finite number, got inf"),
        (lambda: Gate("a", 0, Comparison.BELOW, float("nan")), "threshold must be a finite number, got nan"),
        (lambda: replace(PLAIN, layer=0, gate=replace(GATE, layer=1)), "gate layer 1 comes after the steered layer 0"),
    ]:
        with pytest.raises(GatewayError, match=message) as caught:
            make()
        assert caught.value.code is Code.INVALID_ARGUMENT
    replace(PLAIN, layer=0, gate=GATE)  # the steered layer itself is allowed


def test_a_gate_is_part_of_the_entrys_identity() -> None:
    assert digest((GATED,)) != digest((PLAIN,))
    assert digest((GATED,)) != digest((replace(GATED, gate=replace(GATE, threshold=0.5)),))
    assert digest((GATED,)) != digest((replace(GATED, gate=replace(GATE, comparison=Comparison.BELOW)),))
    assert digest((GATED,)) != digest((replace(GATED, gate=replace(GATE, concept="concept2")),))
    assert digest((GATED,)) == digest((replace(PLAIN, gate=Gate("concept0", 0, Comparison.ABOVE, 0.25)),))
    assert spans((GATED,), 4, 6)[0].digest != spans((PLAIN,), 4, 6)[0].digest
    # an ungated entry keeps the digest steering records made before gates existed
    old = json.dumps([[PLAIN.layer, PLAIN.scale, PLAIN.concept, None, PLAIN.norm_match]])
    assert digest((PLAIN,)) == hashlib.sha256(old.encode()).hexdigest()[:16]


async def test_the_model_decides_what_a_gate_can_read(tiny_service: Any) -> None:
    info = tiny_service.info()
    checks.check_steering(info, (GATED, replace(GATED, gate=replace(GATE, layer=1))))
    for entry, message in [
        (replace(GATED, gate=replace(GATE, concept="french")), "entry 0: unknown gate concept 'french'; the pack has"),
    ]:
        with pytest.raises(GatewayError, match=message) as caught:
            checks.check_steering(info, (entry,))
        assert caught.value.code is Code.INVALID_ARGUMENT
    sparse = replace(info, readouts=replace(info.readouts, layers=(1, 2)))  # a pack without layer 0
    with pytest.raises(GatewayError, match=r"gate layer 0 is not a layer of the concept pack; gate on one of 1$"):
        checks.check_steering(sparse, (GATED,))
    without_gates = replace(info, steering_gates=False, engine_name="custom")  # an engine that steers without gates
    with pytest.raises(
        GatewayError, match="readout-gated steering is not supported by the custom engine; steer without"
    ):
        checks.check_steering(without_gates, (GATED,))
    checks.check_steering(without_gates, (PLAIN,))


def test_json_reads_a_gate_and_names_the_field_it_refuses() -> None:
    budget = RequestBudget()
    gate = {"concept": "concept0", "layer": 0, "comparison": "above", "threshold": 0.25}
    entry = {"concept": "concept1", "layer": 1, "scale": 4, "gate": gate}
    assert read_steering([entry], budget) == (GATED,)
    for bad, message in [
        ({**gate, "threshold": "x"}, r"steering\[0\].gate.threshold must be a number"),
        ({**gate, "threshold": 1e400}, "threshold must be a finite number"),
        ({**gate, "comparison": "over"}, r"gate.comparison must be one of above, below, got \"over\""),
        ({k: v for k, v in gate.items() if k != "comparison"}, "gate.comparison must be one of above, below"),
        ({**gate, "layer": 1.5}, "gate.layer must be an integer"),
        ({**gate, "concept": None}, "gate.concept must be a string"),
        ({**gate, "when": 1}, "gate has unknown keys 'when'"),
        ([], r"steering\[0\].gate must be an object, got list"),
        ({**gate, "layer": 2}, r"steering\[0\]: steering gate layer 2 comes after the steered layer 1"),
    ]:
        with pytest.raises(GatewayError, match=message) as caught:
            read_steering([{**entry, "gate": bad}], budget)
        assert caught.value.code is Code.INVALID_ARGUMENT
