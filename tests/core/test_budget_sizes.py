"""The budget's limits that follow from the served models: JSON values and a direction's length."""

from __future__ import annotations

import json

import pytest

from prismgate.core.budget import RequestBudget, json_values
from prismgate.core.errors import Code, GatewayError
from prismgate.core.steering import SteeringEntry

BUDGET = RequestBudget().sized(hidden_size=128, context=4096)


def test_values_are_counted_outside_strings_only() -> None:
    """Two keys, a list of three: commas and containers outside the strings, plus one."""
    text = json.dumps({"prompt": "a, [b], {c}, " * 200_000, "ids": [1, 2, 3]})
    assert json_values(text, BUDGET.max_json_values) == json_values(text.encode(), BUDGET.max_json_values) == 6
    BUDGET.check_json(text, "the body")  # megabytes of commas in a prompt are text, not values


def test_a_list_of_more_values_than_the_models_need_is_refused_unparsed() -> None:
    raw = b'{"steering": [{"direction": [' + b"0.5," * BUDGET.max_json_values + b"0.5]}]}"
    with pytest.raises(GatewayError) as refused:
        BUDGET.check_json(raw, "the body")
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert f"more than {BUDGET.max_json_values} JSON values" in refused.value.message


def test_the_limits_follow_the_models() -> None:
    small, large = RequestBudget().sized(64, 2048), RequestBudget().sized(4096, 131072)
    assert small.max_json_values < large.max_json_values and small.max_config_bytes < large.max_config_bytes
    small.check_direction(64, "d")
    with pytest.raises(GatewayError, match=r"d has 65 numbers; .*at most 64"):
        small.check_direction(65, "d")


@pytest.mark.parametrize("value", [1e-200, 1.2e154, 1e200, 5e-324, -1e308])
def test_a_direction_of_extreme_numbers_normalises_like_any_other(value: float) -> None:
    unit = SteeringEntry(layer=0, scale=1, direction=(value,) * 576).unit_direction()
    want = SteeringEntry(layer=0, scale=1, direction=(1.0 if value > 0 else -1.0,) * 576).unit_direction()
    assert unit == pytest.approx(want, rel=1e-12)
