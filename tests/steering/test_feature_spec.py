"""Steering by SAE feature in the core: the entry's own rules, the checks against a model, its identity."""

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
from prismgate.core.features import FeatureManifest
from prismgate.core.steering import (
    Comparison,
    Gate,
    Positions,
    SteeringEntry,
    digest,
    effective,
    from_json,
    spans,
    to_json,
)

ADD = SteeringEntry(layer=2, scale=8.0, feature=9)
CLAMP = SteeringEntry(layer=2, scale=0.0, feature=9, clamp=4.0)
FEATURE_GATE = Gate(None, 1, Comparison.ABOVE, 0.5, feature=3)


def test_a_feature_entry_checks_what_it_can_alone() -> None:
    for kwargs, message in [
        ({"layer": 0, "scale": 1.0, "feature": 1, "concept": "a"}, "exactly one of the three"),
        ({"layer": 0, "scale": 1.0, "feature": 1, "direction": (1.0,)}, "exactly one of the three"),
        ({"layer": 0, "scale": 1.0, "feature": -1}, "steering feature must be >= 0, got -1"),
        ({"layer": 0, "scale": 1.0, "feature": 1, "clamp": 2.0}, "a scale or a clamp, not both"),
        ({"layer": 0, "scale": 0.0, "concept": "a", "clamp": 2.0}, "it goes with a feature"),
        ({"layer": 0, "scale": 0.0, "feature": 1, "clamp": 2.0, "norm_match": True}, "takes no norm_match"),
        ({"layer": 0, "scale": 0.0, "feature": 1, "clamp": 1000.5}, r"clamp must be in \[-1000, 1000\]"),
        ({"layer": 0, "scale": 0.0, "feature": 1, "clamp": float("nan")}, "clamp must be in"),
        ({"layer": 0, "scale": 300.0, "feature": 1}, "must be in"),
    ]:
        with pytest.raises(GatewayError, match=message) as caught:
            SteeringEntry(**kwargs)
        assert caught.value.code is Code.INVALID_ARGUMENT
    for kwargs, message in [
        ({"concept": "a", "feature": 1}, "a concept or a feature, not both"),
        ({"concept": None}, "names a concept of the pack"),
        ({"concept": None, "feature": -2}, "gate feature must be >= 0"),
    ]:
        with pytest.raises(GatewayError, match=message):
            Gate(layer=0, comparison=Comparison.ABOVE, threshold=0.0, **kwargs)
    # a clamp always counts: even a clamp to 0 moves an active feature
    assert effective((CLAMP, replace(CLAMP, clamp=0.0), replace(ADD, scale=0.0))) == (CLAMP, replace(CLAMP, clamp=0.0))


def test_the_feature_and_the_clamp_are_part_of_the_entrys_identity() -> None:
    """The digest names what a cached position was computed under: every field that changes it counts."""
    variants = [
        ADD,
        replace(ADD, feature=10),
        replace(ADD, layer=1),
        replace(ADD, scale=4.0),
        CLAMP,
        replace(CLAMP, clamp=4.5),
        replace(CLAMP, feature=10),
        replace(CLAMP, gate=FEATURE_GATE),
        replace(CLAMP, gate=replace(FEATURE_GATE, feature=4)),
        replace(CLAMP, gate=replace(FEATURE_GATE, threshold=0.25)),
        replace(CLAMP, gate=Gate("concept0", 1, Comparison.ABOVE, 0.5)),
        SteeringEntry(layer=2, scale=8.0, direction=(1.0, 0.0)),
        SteeringEntry(layer=2, scale=8.0, concept="concept9"),
    ]
    assert len({digest((v,)) for v in variants}) == len(variants)
    assert spans((CLAMP,), 4, 6)[0].digest != spans((ADD,), 4, 6)[0].digest
    # entries without a feature keep the digests recorded before features existed
    plain = SteeringEntry(layer=1, scale=4.0, concept="concept1", gate=Gate("concept0", 0, Comparison.ABOVE, 0.25))
    old = json.dumps([[1, 4.0, "concept1", None, False, ["concept0", 0, "above", 0.25]]])
    assert digest((plain,)) == hashlib.sha256(old.encode()).hexdigest()[:16]


def test_a_session_store_row_round_trips_every_field() -> None:
    for entry in (ADD, CLAMP, replace(CLAMP, gate=FEATURE_GATE, positions=Positions.GENERATED)):
        assert from_json(json.loads(json.dumps(to_json(entry)))) == entry
    # a row stored before features existed reads as it did
    assert from_json([3, 4.0, "french", None, False, "both", ["french", 1, "below", -0.75]]) == SteeringEntry(
        layer=3, scale=4.0, concept="french", gate=Gate("french", 1, Comparison.BELOW, -0.75)
    )


def test_json_reads_feature_entries_and_gates() -> None:
    budget = RequestBudget()
    gate = {"feature": 3, "layer": 1, "comparison": "above", "threshold": 0.5}
    assert read_steering([{"feature": 9, "layer": 2, "scale": 8}], budget) == (ADD,)
    assert read_steering([{"feature": 9, "layer": 2, "clamp": 4}], budget) == (CLAMP,)
    assert read_steering([{"feature": 9, "layer": 2, "clamp": 4, "gate": gate}], budget) == (
        replace(CLAMP, gate=FEATURE_GATE),
    )
    for bad, message in [
        ({"feature": 9, "layer": 2, "clamp": True}, r"steering\[0\].clamp must be a number"),
        ({"feature": 9.5, "layer": 2, "scale": 1}, r"steering\[0\].feature must be an integer"),
        ({"feature": 2**40, "layer": 2, "scale": 1}, r"feature must be in \[0, 2\^31\)"),
        ({"feature": 9, "layer": 2, "clamp": 1e400}, r"clamp must be in \[-1000, 1000\], got inf"),
        ({"feature": 9, "layer": 2, "clamp": 1, "gate": {**gate, "feature": "x"}}, r"gate.feature must be an integer"),
    ]:
        with pytest.raises(GatewayError, match=message):
            read_steering([bad], budget)


async def test_the_model_decides_which_features_can_steer(tiny_service: Any) -> None:
    info = replace(
        tiny_service.info(),
        features=FeatureManifest(layers=(1, 2), widths=(256, 512), hidden_size=128),
        steering_features=True,
    )
    checks.check_steering(info, (ADD, replace(CLAMP, feature=511), replace(CLAMP, gate=FEATURE_GATE)))
    checks.check_steering(info, (SteeringEntry(layer=2, scale=1.0, direction=(1.0,) * 128),))  # an SAE layer
    for entry, message in [
        (
            replace(ADD, layer=0),
            "entry 0: layer 0 has no SAE, so no feature 9 to steer by; the model's SAEs read after layers 1, 2",
        ),
        (replace(ADD, feature=512), r"entry 0: feature 512 is outside the SAE's features \[0, 512\) at layer 2"),
        (replace(ADD, layer=1, feature=256), r"feature 256 is outside the SAE's features \[0, 256\) at layer 1"),
        (replace(CLAMP, gate=replace(FEATURE_GATE, layer=0)), "entry 0: gate: layer 0 has no SAE"),
        (
            replace(CLAMP, gate=replace(FEATURE_GATE, feature=300)),
            r"gate: feature 300 is outside the SAE's features \[0, 256\)",
        ),
        (
            SteeringEntry(layer=3, scale=1.0, direction=(1.0,) * 128),
            "layer 3 has neither a concept pack layer nor an SAE",
        ),
        (
            SteeringEntry(layer=2, scale=1.0, direction=(1.0,) * 7),
            "a direction of 7 numbers; the model's hidden size is 128",
        ),
    ]:
        with pytest.raises(GatewayError, match=message) as caught:
            checks.check_steering(info, (entry,))
        assert caught.value.code is Code.INVALID_ARGUMENT
    # an engine that reads features but cannot steer by them (both of prismgate's engines now can): named,
    # for entries and gates
    reads_only = replace(info, steering_features=False, engine_name="remote")
    for entry in (ADD, replace(SteeringEntry(layer=1, scale=1.0, concept="concept0"), gate=FEATURE_GATE)):
        with pytest.raises(GatewayError, match=r"steering by SAE feature .* is not supported by the remote engine"):
            checks.check_steering(reads_only, (entry,))
    with pytest.raises(GatewayError, match="layer 2 is not a layer of the concept pack"):  # nor a direction there
        checks.check_steering(reads_only, (SteeringEntry(layer=2, scale=1.0, direction=(1.0,) * 128),))
    with pytest.raises(GatewayError, match="has no sparse autoencoder loaded"):
        checks.check_steering(replace(info, features=None), (ADD,))
