"""GenerateSpec and PositionRange validation."""

from __future__ import annotations

import math

import pytest

from prismgate.core.actions import GenerateSpec, PositionRange, covered, first_covered
from prismgate.core.errors import Code, GatewayError


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"logprob_top_k": 21}, "top-k"),
        ({"stop_token_ids": (-1,)}, "stop token"),
        ({"stop_strings": ("",)}, "stop strings"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_specs_are_invalid_argument(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(GatewayError) as e:
        GenerateSpec(**kwargs)  # type: ignore[arg-type]
    assert e.value.code is Code.INVALID_ARGUMENT and fragment in e.value.message


def test_ranges() -> None:
    with pytest.raises(GatewayError):
        PositionRange(5, 2)
    with pytest.raises(GatewayError):
        PositionRange(-1, 2)
    r = (PositionRange(2, 4), PositionRange(10, 11))
    assert [p for p in range(12) if covered(r, p)] == [2, 3, 10]
    assert first_covered(r) == 2
    assert first_covered((PositionRange(3, 3),)) is None
    assert not GenerateSpec(readout_ranges=(PositionRange(3, 3),)).wants_readouts
