"""The steering spec in the core: its own rules, the checks against a model, and a session's record."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from prismgate.core import checks
from prismgate.core.actions import GenerateAction, GenerateSpec
from prismgate.core.budget import RequestBudget
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done
from prismgate.core.steering import (
    Positions,
    SteeredSpan,
    SteeringEntry,
    agreed_prefix,
    clip,
    digest,
    spans,
)

FRENCH = SteeringEntry(layer=0, scale=4.0, concept="concept1")


def test_an_entry_checks_what_it_can_alone() -> None:
    for kwargs, message in [
        ({"layer": 0, "scale": 1.0}, "exactly one of the two"),
        ({"layer": 0, "scale": 1.0, "concept": "a", "direction": (1.0,)}, "exactly one of the two"),
        ({"layer": -1, "scale": 1.0, "concept": "a"}, "layer must be >= 0"),
        ({"layer": 0, "scale": 257.0, "concept": "a"}, "without norm matching must be in [-256, 256]"),
        ({"layer": 0, "scale": float("nan"), "concept": "a"}, "must be in"),
        ({"layer": 0, "scale": -4.5, "concept": "a", "norm_match": True}, "with norm matching must be in [-4, 4]"),
        ({"layer": 0, "scale": 1.0, "direction": (0.0, 0.0)}, "all zeros"),
        ({"layer": 0, "scale": 1.0, "direction": (1.0, float("inf"))}, "finite"),
    ]:
        with pytest.raises(GatewayError, match=message.replace("[", r"\[").replace("]", r"\]")) as caught:
            SteeringEntry(**kwargs)
        assert caught.value.code is Code.INVALID_ARGUMENT
    assert SteeringEntry(layer=0, scale=2.0, direction=(3.0, 4.0)).unit_direction() == (0.6, 0.8)


def test_the_span_of_a_run_is_exactly_the_positions_the_entry_steers() -> None:
    """The one rule every engine asks, against the rule spelled out position by position."""
    wanted = {
        Positions.PROMPT: lambda p, n: p < n,
        Positions.GENERATED: lambda p, n: p >= n,
        Positions.BOTH: lambda p, n: True,
    }
    for positions, steers in wanted.items():
        for prompt_len in range(6):
            for start in range(7):
                for tokens in range(5):
                    lo, hi = positions.span(start, tokens, prompt_len)
                    assert 0 <= lo <= hi <= tokens
                    got = set(range(lo, hi))
                    assert got == {i for i in range(tokens) if steers(start + i, prompt_len)}
                    assert all(positions.covers(start + i, prompt_len) == (i in got) for i in range(tokens))


def test_spans_tile_the_timeline_by_the_steering_each_position_gets() -> None:
    prompt, generated, both = (replace(FRENCH, positions=p) for p in Positions)
    assert spans((), 5, 8) == (SteeredSpan(0, 8, ""),)
    assert spans((both,), 5, 8) == (SteeredSpan(0, 8, digest((both,))),)
    assert spans((prompt,), 5, 8) == (SteeredSpan(0, 5, digest((prompt,))), SteeredSpan(5, 8, ""))
    assert spans((generated,), 5, 5) == (SteeredSpan(0, 5, ""),)
    # what a position gets counts, not how the spec spells it: prompt-only and both agree on the prompt
    assert digest((prompt,)) == digest((both,)) != digest((replace(FRENCH, scale=4.5),))
    assert agreed_prefix(spans((prompt,), 5, 8), spans((both,), 5, 8)) == 5
    assert agreed_prefix(spans((generated,), 5, 8), spans((), 7, 7)) == 5
    assert agreed_prefix((), spans((), 3, 3)) == 0
    assert clip(spans((prompt,), 5, 8), 6) == (SteeredSpan(0, 5, digest((prompt,))), SteeredSpan(5, 6, ""))


def test_the_budget_caps_the_entries() -> None:
    RequestBudget().check_spec(GenerateSpec(steering=(FRENCH,) * 8))
    with pytest.raises(GatewayError, match="9 steering entries; the limit is 8"):
        RequestBudget().check_spec(GenerateSpec(steering=(FRENCH,) * 9))


async def test_the_model_decides_what_can_be_steered(tiny_service: Any) -> None:
    info = tiny_service.info()
    checks.check_steering(info, (FRENCH, SteeringEntry(layer=1, scale=1.0, direction=(1.0,) * 128)))
    for entry, message in [
        (replace(FRENCH, concept="french"), "unknown concept 'french'; the pack has concept0, concept1, concept2"),
        (replace(FRENCH, layer=2), "layer 2 is not a layer of the concept pack; steer at one of 0, 1"),
        (SteeringEntry(layer=0, scale=1.0, direction=(1.0,) * 64), "a direction of 64 numbers"),
    ]:
        with pytest.raises(GatewayError, match=message):
            checks.check_steering(info, (entry,))
    with pytest.raises(GatewayError, match="has no concept pack"):
        checks.check_steering(replace(info, readouts=None), (FRENCH,))
    with pytest.raises(GatewayError, match="steering is not supported by the echo engine yet") as caught:
        checks.check_steering(replace(info, steering=False, engine_name="echo"), (FRENCH,))
    assert caught.value.code is Code.INVALID_ARGUMENT


async def run(service: Any, session_id: str, action: GenerateAction) -> Done:
    async for event in service.generate(session_id, action):
        if isinstance(event, Done):
            return event
    raise AssertionError("no Done")


async def test_steered_then_unsteered_turns_prefill_what_they_must(tiny_service: Any) -> None:
    s = await tiny_service.open()
    prompt = tuple(range(40, 60))
    spec = GenerateSpec(max_tokens=4, ignore_eos=True, steering=(FRENCH,))
    done = await run(tiny_service, s.id, GenerateAction(append_tokens=prompt, offset=0, spec=spec))
    assert (done.cached_tokens, done.prefilled_tokens) == (0, 20)
    assert (await tiny_service.session(s.id)).steering == (SteeredSpan(0, 24, digest((FRENCH,))),)
    # the same steering again: only the new tokens (and the last sampled one) run
    done = await run(tiny_service, s.id, GenerateAction(append_tokens=(70, 71), offset=24, spec=spec))
    assert (done.cached_tokens, done.prefilled_tokens) == (23, 3)
    # unsteered: nothing computed under the steering may serve, the whole timeline runs again
    plain = GenerateSpec(max_tokens=4, ignore_eos=True)
    done = await run(tiny_service, s.id, GenerateAction(append_tokens=(72,), offset=30, spec=plain))
    assert (done.cached_tokens, done.prefilled_tokens) == (0, 31)
    assert (await tiny_service.session(s.id)).steering == (SteeredSpan(0, 35, ""),)
    # steering only what is generated: the unsteered prompt's cache serves
    gen = GenerateSpec(max_tokens=4, ignore_eos=True, steering=(replace(FRENCH, positions=Positions.GENERATED),))
    done = await run(tiny_service, s.id, GenerateAction(append_tokens=(73,), offset=35, spec=gen))
    assert (done.cached_tokens, done.prefilled_tokens) == (34, 2)
    record = (await tiny_service.session(s.id)).steering
    assert record == (SteeredSpan(0, 36, ""), SteeredSpan(36, 40, digest((FRENCH,))))
    # a refused turn leaves the record as it was
    bad = GenerateSpec(max_tokens=4, steering=(replace(FRENCH, concept="nope"),))
    with pytest.raises(GatewayError, match="unknown concept 'nope'"):
        await run(tiny_service, s.id, GenerateAction(append_tokens=(74,), offset=40, spec=bad))
    assert (await tiny_service.session(s.id)).steering == record and len(await tiny_service.session(s.id)) == 40
