"""The Session/Action core's rules, through a real engine on the tiny model."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prismgate.core.actions import GenerateAction, GenerateSpec, ImageInput, PositionRange
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, FinishReason, TokenEvent


async def collect(service: Any, session_id: str, action: GenerateAction) -> tuple[list[TokenEvent], Done]:
    events: list[TokenEvent] = []
    async for ev in service.generate(session_id, action):
        if isinstance(ev, Done):
            return events, ev
        events.append(ev)
    raise AssertionError("no Done")


async def expect_error(code: Code, agen: Any) -> GatewayError:
    with pytest.raises(GatewayError) as e:
        async for _ in agen:
            pass
    assert e.value.code is code, e.value
    return e.value


def spec(**kw: Any) -> GenerateSpec:
    kw.setdefault("ignore_eos", True)
    return GenerateSpec(**kw)


async def test_open_checks_the_model_name(tiny_service: Any) -> None:
    with pytest.raises(GatewayError) as e:
        await tiny_service.open("gpt-4")
    assert e.value.code is Code.NOT_FOUND
    assert "'gpt-4'" in e.value.message and "'tiny-llama'" in e.value.message


async def test_turns_append_and_decoded_tokens_join_the_session(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    events, done = await collect(
        tiny_service, s.id, GenerateAction(append_tokens=(1, 2, 3), offset=0, spec=spec(max_tokens=4))
    )
    generated = [e.id for e in events]
    assert await tiny_service.dump(s.id) == [1, 2, 3, *generated]
    assert done.prompt_tokens == 3 and done.completion_tokens == 4 and done.total_tokens == 7
    _, done2 = await collect(tiny_service, s.id, GenerateAction(append_tokens=(9,), offset=7, spec=spec(max_tokens=2)))
    assert len(await tiny_service.dump(s.id)) == 10
    assert done2.cached_tokens >= 6  # the engine reused the session's prefix


async def test_offset_drift_is_a_failed_precondition_naming_both_lengths(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    await collect(tiny_service, s.id, GenerateAction(append_tokens=(1, 2, 3), offset=0, spec=spec(max_tokens=0)))
    err = await expect_error(
        Code.FAILED_PRECONDITION, tiny_service.generate(s.id, GenerateAction(append_tokens=(4,), offset=2))
    )
    assert "offset 2" in err.message and "length 3" in err.message
    err = await expect_error(
        Code.FAILED_PRECONDITION,
        tiny_service.generate(s.id, GenerateAction(append_tokens=(4,), offset=5, truncating=True)),
    )
    assert "offset 5" in err.message and "length 3" in err.message
    assert await tiny_service.dump(s.id) == [1, 2, 3]  # nothing changed


async def test_truncating_rewinds_then_appends(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    await collect(tiny_service, s.id, GenerateAction(append_tokens=(1, 2, 3, 4), offset=0, spec=spec(max_tokens=0)))
    await collect(
        tiny_service, s.id, GenerateAction(append_tokens=(7, 8), offset=2, truncating=True, spec=spec(max_tokens=0))
    )
    assert await tiny_service.dump(s.id) == [1, 2, 7, 8]


async def test_prefill_only_with_ranges_and_the_no_op_refresh(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    events, done = await collect(
        tiny_service,
        s.id,
        GenerateAction(
            append_tokens=(1, 2, 3, 4), offset=0, spec=spec(max_tokens=0, readout_ranges=(PositionRange(1, 3),))
        ),
    )
    assert [e.position for e in events] == [1, 2] and all(e.readout is not None for e in events)
    assert done.finish_reason is FinishReason.PREFILL_ONLY
    before = s.last_used
    await asyncio.sleep(0.01)
    events, done = await collect(tiny_service, s.id, GenerateAction(offset=4, spec=spec(max_tokens=0)))
    assert events == [] and done.prompt_tokens == 4 and s.last_used > before


async def test_cancelled_generation_keeps_the_append_and_drops_decoded_tokens(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    stream = tiny_service.generate(s.id, GenerateAction(append_tokens=(1, 2, 3), offset=0, spec=spec(max_tokens=300)))
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.aclose()
    assert await tiny_service.dump(s.id) == [1, 2, 3]
    assert not s.busy
    _, done = await collect(tiny_service, s.id, GenerateAction(append_tokens=(5,), offset=3, spec=spec(max_tokens=1)))
    assert done.completion_tokens == 1


async def test_a_second_generation_on_a_busy_session_is_aborted(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    first = tiny_service.generate(s.id, GenerateAction(append_tokens=(1, 2), offset=0, spec=spec(max_tokens=50)))
    await first.__anext__()
    await expect_error(Code.ABORTED, tiny_service.generate(s.id, GenerateAction(offset=None, spec=spec(max_tokens=1))))
    await first.aclose()


async def test_context_overflow_is_resource_exhausted(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    err = await expect_error(
        Code.RESOURCE_EXHAUSTED,
        tiny_service.generate(s.id, GenerateAction(append_tokens=tuple([5] * 500), offset=0, spec=spec(max_tokens=20))),
    )
    assert "500" in err.message and "512" in err.message
    await expect_error(
        Code.RESOURCE_EXHAUSTED,
        tiny_service.generate(s.id, GenerateAction(append_tokens=tuple([5] * 513), offset=0, spec=spec(max_tokens=0))),
    )
    assert await tiny_service.dump(s.id) == []


@pytest.mark.parametrize(
    ("action", "fragment"),
    [
        (GenerateAction(append_tokens=(1, 10**6), offset=0), "outside the vocabulary"),
        (
            GenerateAction(append_tokens=(1, 2), offset=0, images=(ImageInput(b"x", "image/png", 0, 2),)),
            "takes no images",
        ),
        (
            GenerateAction(
                append_tokens=(1, 2), offset=0, spec=GenerateSpec(max_tokens=1, logprob_ranges=(PositionRange(0, 9),))
            ),
            "reaches past position 3",
        ),
        (GenerateAction(offset=0, spec=GenerateSpec(max_tokens=3)), "empty timeline"),
        (GenerateAction(truncating=True), "truncating needs an offset"),
    ],
)
async def test_bad_actions_are_invalid_argument(tiny_service: Any, action: GenerateAction, fragment: str) -> None:
    s = await tiny_service.open("tiny-llama")
    err = await expect_error(Code.INVALID_ARGUMENT, tiny_service.generate(s.id, action))
    assert fragment in err.message
    assert await tiny_service.dump(s.id) == []


async def test_unknown_session_is_not_found(tiny_service: Any) -> None:
    await expect_error(Code.NOT_FOUND, tiny_service.generate("missing", GenerateAction()))
    with pytest.raises(GatewayError) as e:
        await tiny_service.fork("missing", 0)
    assert e.value.code is Code.NOT_FOUND


async def test_stop_strings_end_with_stop_string_and_cut_the_text(tiny_service: Any) -> None:
    tokens = tuple(tiny_service.info().tokenizer.encode("stop string test"))
    free = [
        ev
        async for ev in tiny_service.run(
            GenerateAction(append_tokens=tokens, spec=spec(max_tokens=12), detokenize=True)
        )
    ]
    text = "".join(e.text or "" for e in free if isinstance(e, TokenEvent)) + (free[-1].text or "")
    stop = text[5:7]
    assert len(stop) == 2
    cut = [
        ev
        async for ev in tiny_service.run(
            GenerateAction(append_tokens=tokens, spec=spec(max_tokens=12, stop_strings=(stop,)), detokenize=True)
        )
    ]
    done = cut[-1]
    assert isinstance(done, Done) and done.finish_reason is FinishReason.STOP_STRING and done.stop_string == stop
    shown = "".join(e.text or "" for e in cut if isinstance(e, TokenEvent)) + (done.text or "")
    assert shown == text[: text.index(stop)]


async def test_fork_then_diverge(tiny_service: Any) -> None:
    s = await tiny_service.open("tiny-llama")
    await collect(tiny_service, s.id, GenerateAction(append_tokens=(1, 2, 3, 4, 5), offset=0, spec=spec(max_tokens=0)))
    child = await tiny_service.fork(s.id, 3)
    await collect(tiny_service, child.id, GenerateAction(append_tokens=(9,), offset=3, spec=spec(max_tokens=0)))
    assert await tiny_service.dump(child.id) == [1, 2, 3, 9]
    assert await tiny_service.dump(s.id) == [1, 2, 3, 4, 5]


async def test_the_store_wide_token_cap_counts_the_decode_budget_before_anything_runs(tiny_service: Any) -> None:
    tiny_service.store.max_total_tokens = 20
    s = await tiny_service.open("tiny-llama")
    await collect(tiny_service, s.id, GenerateAction(append_tokens=(1, 2, 3, 4, 5), offset=0, spec=spec(max_tokens=5)))
    assert len(await tiny_service.dump(s.id)) == 10
    err = await expect_error(
        Code.RESOURCE_EXHAUSTED,
        tiny_service.generate(s.id, GenerateAction(append_tokens=(6,), offset=10, spec=spec(max_tokens=10))),
    )
    assert "holds 10 session tokens and 11 more" in err.message and "limit of 20" in err.message
    assert len(await tiny_service.dump(s.id)) == 10  # refused before anything was appended or decoded
    _, done = await collect(tiny_service, s.id, GenerateAction(append_tokens=(6,), offset=10, spec=spec(max_tokens=9)))
    assert done.completion_tokens == 9 and len(await tiny_service.dump(s.id)) == 20
