"""The embedded default model, SmolLM2-135M-Instruct: real weights, real answers (slow)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import pytest_asyncio

from prismgate.core.actions import PositionRange
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
from tests.engines.requests import chat, run

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol() -> Any:
    engine = TransformersEngine(default_model_path(), model_id=DEFAULT_MODEL_ID, threads=1)
    await engine.start()
    yield engine
    await engine.close()


async def test_it_knows_the_capital_of_france(smol: Any) -> None:
    events, done = await run(smol, chat(smol, "What is the capital of France? Answer in one sentence."), max_tokens=24)
    text = smol.info.tokenizer.decode([e.id for e in events])
    assert "Paris" in text
    assert done.finish_reason.value == "eos"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol_fp32() -> Any:
    engine = TransformersEngine(default_model_path(), model_id=DEFAULT_MODEL_ID, threads=1, dtype="float32")
    await engine.start()
    yield engine
    await engine.close()


# bf16 rounds coarsely, and each CPU kind otherwise: the worst difference measured was 0.166 with AMX
@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.25), ("float32", 2e-3)])
async def test_session_delta_prefill_equals_full_recompute(
    smol: Any, smol_fp32: Any, dtype: str, tolerance: float
) -> None:
    """Same greedy tokens either way; logprobs equal to float rounding (bf16 rounds coarsely)."""
    smol = smol if dtype == "bfloat16" else smol_fp32
    key = uuid.uuid4().hex
    first = chat(smol, "Name three primary colours.")
    out1, _ = await run(smol, first, session=key, max_tokens=20)
    history = first + tuple(e.id for e in out1)
    follow = chat(
        smol, "Name three primary colours.", smol.info.tokenizer.decode([e.id for e in out1]), "Which one is warmest?"
    )
    # the follow-up turn as a client would send it: the history, then the new user turn
    turn = history + follow[len(chat(smol, "Name three primary colours.")) + len(out1) :]
    n = len(turn)
    ranges = {"logprob_ranges": (PositionRange(n, n + 16),)}
    cached, done_c = await run(smol, turn, session=key, max_tokens=16, **ranges)
    fresh, done_f = await run(smol, turn, max_tokens=16, **ranges)
    assert done_c.cached_tokens >= len(history) - 1 and done_f.cached_tokens == 0
    assert done_c.prefilled_tokens <= n - len(history) + 1
    assert [e.id for e in cached] == [e.id for e in fresh]
    worst = max(abs(a.logprob - b.logprob) for a, b in zip(cached, fresh, strict=True))
    assert worst < tolerance, worst
