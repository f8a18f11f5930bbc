"""The core's policies for chat-shaped turns, through a real engine on the tiny model:
prompt planning, the one max_tokens rule, reports, the budget and turn atomicity."""

from __future__ import annotations

from typing import Any

import pytest

from prismgate.core.actions import GenerateSpec
from prismgate.core.budget import RequestBudget
from prismgate.core.chat import Message, TextPart
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done
from prismgate.core.health import LOADING
from prismgate.core.limits import ContextOverflow, max_tokens_for
from prismgate.core.models import UnknownModel
from prismgate.core.prompts import Messages, Placement, Text, Tokens
from prismgate.core.turns import ChatTurn


def user(text: str) -> Messages:
    return Messages([Message("user", [TextPart(text)])])


async def run(service: Any, turn: Any) -> Done:
    async for event in service.run_turn(turn):
        if isinstance(event, Done):
            return event
    raise AssertionError("no Done")


def test_max_tokens_rule() -> None:
    assert max_tokens_for(None, prompt_tokens=10, context=100, default=None) == 90  # as much as fits
    assert max_tokens_for(None, prompt_tokens=10, context=100, default=16) == 16
    assert max_tokens_for(None, prompt_tokens=95, context=100, default=16) == 5  # the default, capped by the room
    assert max_tokens_for(40, prompt_tokens=10, context=100, default=16) == 40  # asked for: exactly that
    with pytest.raises(ContextOverflow) as e:
        max_tokens_for(91, prompt_tokens=10, context=100, default=None)  # never silently clamped
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "exceeds the model's context of 100" in e.value.message
    with pytest.raises(ContextOverflow):
        max_tokens_for(None, prompt_tokens=100, context=100, default=16)  # no room at all
    with pytest.raises(GatewayError, match="max_tokens must be >= 0"):
        max_tokens_for(-1, prompt_tokens=1, context=100, default=None)


def test_prompt_size_is_refused_before_tokenizing() -> None:
    budget = RequestBudget(prompt_bytes_per_context_token=4)
    budget.check_prompt(Text("a" * 400), context=100)
    with pytest.raises(ContextOverflow, match="over 400 bytes"):
        budget.check_prompt(Text("a" * 401), context=100)
    with pytest.raises(ContextOverflow):  # counted in UTF-8 bytes, not characters
        budget.check_prompt(user("é" * 201), context=100)
    budget.check_prompt(Tokens(tuple(range(10_000))), context=100)  # token ids are checked against the context


async def test_unknown_model_is_not_found_and_loading_is_unavailable(
    tiny_service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UnknownModel) as e:
        await tiny_service.plan_turn(ChatTurn(prompt=user("hi"), origin="t"), model="gpt-4")
    assert e.value.code is Code.NOT_FOUND and "'tiny-llama'" in e.value.message
    monkeypatch.setattr(tiny_service.pool, "health", lambda: LOADING)
    with pytest.raises(GatewayError) as e2:
        tiny_service.models.require_ready()
    assert e2.value.code is Code.UNAVAILABLE and "still loading" in e2.value.message


async def test_replace_keeps_the_shared_prefix_and_continue_appends(tiny_service: Any) -> None:
    s = await tiny_service.open()
    first = await tiny_service.plan_turn(ChatTurn(prompt=user("Hello"), origin="t", max_tokens=2), session_id=s.id)
    assert first.reused_tokens == 0 and first.action.spec.max_tokens == 2
    done = await run(tiny_service, first)
    length = len(await tiny_service.dump(s.id))
    assert length == done.prompt_tokens + done.completion_tokens
    again = await tiny_service.plan_turn(
        ChatTurn(prompt=user("Hello there"), origin="t", max_tokens=1), session_id=s.id
    )
    assert 0 < again.reused_tokens < length and again.action.truncating  # diffed against the session
    more = await tiny_service.plan_turn(
        ChatTurn(prompt=Text(" more"), origin="t", max_tokens=1, placement=Placement.CONTINUE), session_id=s.id
    )
    assert more.reused_tokens == length and not more.action.truncating  # placed after the session


async def test_reports_cover_the_generated_positions_or_the_prompt_too(tiny_service: Any) -> None:
    plain = await tiny_service.plan_turn(
        ChatTurn(prompt=Tokens((1, 2, 3)), origin="t", max_tokens=4, logprobs=True, readouts=True)
    )
    spec = plain.action.spec
    assert (
        [(r.start, r.end) for r in spec.logprob_ranges] == [(3, 7)] == [(r.start, r.end) for r in spec.readout_ranges]
    )
    echo = await tiny_service.plan_turn(
        ChatTurn(prompt=Tokens((1, 2, 3)), origin="t", max_tokens=4, logprobs=True, report_prompt=True)
    )
    assert [(r.start, r.end) for r in echo.action.spec.logprob_ranges] == [(0, 7)]
    assert echo.action.spec.readout_ranges == ()


async def test_a_chat_turn_that_does_not_finish_leaves_the_session_as_it_was(tiny_service: Any) -> None:
    s = await tiny_service.open()
    await run(
        tiny_service,
        await tiny_service.plan_turn(ChatTurn(prompt=user("Hi"), origin="t", max_tokens=2), session_id=s.id),
    )
    before = await tiny_service.dump(s.id)
    sampling = GenerateSpec(ignore_eos=True)
    turn = await tiny_service.plan_turn(
        ChatTurn(prompt=user("Hello, a longer one"), origin="t", max_tokens=50, sampling=sampling), session_id=s.id
    )
    assert turn.action.truncating  # it rewinds part of the session before appending
    stream = tiny_service.run_turn(turn)
    await anext(stream)  # under way: appended, decoding
    assert await tiny_service.dump(s.id) != before
    await stream.aclose()  # the client went away
    assert await tiny_service.dump(s.id) == before and not s.busy
