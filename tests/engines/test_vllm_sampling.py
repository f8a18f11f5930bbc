"""vLLM's own sampler gets the sampling fields, and agrees with the transformers engine's (tiny model, float32).

Both engines run the same weights in float32 on CPU; greedy decoding under each penalty, bias and
``min_tokens`` must pick the same tokens on both: vLLM's ``SamplingParams`` on one side,
prismgate's sampling module (engines/hf/sampling.py) on the other.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from prismgate.core.actions import Fork, PositionRange
from prismgate.core.errors import Code, GatewayError
from tests.engines.requests import run

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

TOKENS = 16


def prompt(engine: Any) -> tuple[int, ...]:
    return tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": "Tell me a long story."}]))


async def ids(engine: Any, **spec: Any) -> list[int]:
    events, _ = await run(engine, prompt(engine), max_tokens=TOKENS, **spec)
    return [e.id for e in events if not e.is_prefill]


async def test_penalties_and_bias_pick_the_same_tokens_on_both_engines(tiny_pair: Any) -> None:
    hf, vl = tiny_pair
    plain = await ids(hf, ignore_eos=True)
    assert await ids(vl, ignore_eos=True) == plain
    for shaping in (
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 0.8},
        {"presence_penalty": 1.2},
        {"logit_bias": ((plain[3], 4.0), (plain[0], -3.0))},
    ):
        expected = await ids(hf, ignore_eos=True, **shaping)
        assert expected != plain, shaping
        assert await ids(vl, ignore_eos=True, **shaping) == expected, shaping


async def test_min_tokens_holds_a_stop_id_back_on_both_engines(tiny_pair: Any) -> None:
    hf, vl = tiny_pair
    plain = await ids(hf, ignore_eos=True)
    stop = plain[2]
    first = plain.index(stop)
    assert len(await ids(vl, ignore_eos=True, stop_token_ids=(stop,))) == first + 1
    held = await ids(hf, ignore_eos=True, stop_token_ids=(stop,), min_tokens=first + 4)
    assert len(held) >= first + 5 and stop not in held[: first + 4]
    assert await ids(vl, ignore_eos=True, stop_token_ids=(stop,), min_tokens=first + 4) == held


async def test_min_p_of_one_is_greedy_on_vllm(tiny_pair: Any) -> None:
    _, vl = tiny_pair
    plain = await ids(vl, ignore_eos=True)
    assert await ids(vl, ignore_eos=True, temperature=1.5, seed=3, min_p=1.0) == plain


async def test_min_tokens_with_decode_readouts_is_refused(tiny_pair: Any) -> None:
    _, vl = tiny_pair
    p = prompt(vl)
    with pytest.raises(GatewayError) as e:
        await run(vl, p, max_tokens=4, min_tokens=2, readout_ranges=(PositionRange(len(p), len(p) + 4),))
    assert e.value.code is Code.INVALID_ARGUMENT and "min_tokens" in e.value.message


async def test_the_choices_of_one_prompt_share_its_blocks(tiny_pair: Any) -> None:
    _, vl = tiny_pair
    p = tuple(vl.info.tokenizer.render_chat([{"role": "user", "content": "A prompt of more than one block. " * 3}]))
    assert len(p) > 64
    fork = uuid.uuid4().hex
    _, leader = await run(vl, p, fork=Fork(fork, followers=1), max_tokens=2)
    _, follower = await run(vl, p, fork=Fork(fork), max_tokens=2)
    _, stranger = await run(vl, p, max_tokens=2)  # another request of the same prompt: its own salt
    assert leader.cached_tokens == 0 and stranger.cached_tokens == 0
    assert follower.cached_tokens >= 32  # whole blocks of the prompt, from the leader
