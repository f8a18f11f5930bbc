"""Prompt logprobs never hold more than SCORED_CHUNK full-vocabulary rows of logits at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from prismgate.core.actions import PositionRange
from prismgate.engines.hf import TransformersEngine, steps
from tests.engines.requests import run


async def test_a_scored_prompt_runs_in_chunks_whose_logits_stay_small(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(steps, "SCORED_CHUNK", 64)  # below prefill_chunk, on the tiny model's short context
    engine = TransformersEngine(tiny_model_dir, model_id="tiny", threads=1, prefill_chunk=512)
    await engine.start()
    try:
        adapter = engine._adapter
        rows: list[int] = []
        forward = adapter.forward

        def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
            logits = forward(*args, **kwargs)
            rows.append(int(logits.shape[0]))
            return logits

        adapter.forward = counting
        prompt = tuple(5 + i % 200 for i in range(300))  # 300 tokens, every one scored
        events, _ = await run(engine, prompt, max_tokens=0, logprob_ranges=(PositionRange(1, 300),), logprob_top_k=5)
        assert [e.position for e in events] == list(range(1, 300))
        assert all(e.top_logprobs is not None and len(e.top_logprobs) == 5 for e in events)
        assert max(rows) <= 64 and len(rows) >= 300 // 64
        rows.clear()
        await run(engine, prompt, max_tokens=1)  # nothing scored: the prompt goes in one chunk
        assert len(rows) == 1
    finally:
        await engine.close()


async def test_the_heap_is_trimmed_when_requests_end_and_not_more_often_than_its_interval(
    tiny_model_dir: Path,
) -> None:
    engine = TransformersEngine(tiny_model_dir, model_id="tiny", threads=1)
    await engine.start()
    try:
        trimmer = engine._scheduler.trimmer

        async def trims_reach(n: int) -> int:
            for _ in range(500):  # the worker trims after the round that ended the request
                if trimmer.trims >= n:
                    break
                await asyncio.sleep(0.01)
            return trimmer.trims

        prompt = tuple(5 + i % 200 for i in range(100))
        await run(engine, prompt, max_tokens=2)
        assert await trims_reach(1) == 1  # the first request's end
        trimmer.interval_s = 3600.0
        for _ in range(5):  # five more ends within the interval: none trims
            await run(engine, prompt, max_tokens=1)
        await asyncio.sleep(0.2)
        assert trimmer.trims == 1
        trimmer.interval_s = 0.0
        await run(engine, prompt, max_tokens=1)
        assert await trims_reach(2) == 2
    finally:
        await engine.close()


async def test_an_engine_gone_idle_trims_once_more_what_ended_within_the_interval(tiny_model_dir: Path) -> None:
    """A request's answer is built and freed after its generation ends: the idle engine trims once more, later."""
    engine = TransformersEngine(tiny_model_dir, model_id="tiny", threads=1)
    await engine.start()
    try:
        trimmer = engine._scheduler.trimmer
        trimmer.interval_s = 6.0  # a one-token answer on the tiny model ends well within it, even on a loaded machine
        prompt = tuple(5 + i % 200 for i in range(100))
        await run(engine, prompt, max_tokens=1)
        await asyncio.sleep(0.05)
        first = trimmer.trims
        await run(engine, prompt, max_tokens=1)  # ends within the interval: not trimmed at its end
        for _ in range(100):  # the engine's thread marks it after the answer's last event
            if trimmer.pending or trimmer.trims != first:
                break
            await asyncio.sleep(0.05)
        assert trimmer.trims == first and trimmer.pending
        for _ in range(300):  # the idle trim comes an interval later: wait for it, not for a time
            if trimmer.trims != first:
                break
            await asyncio.sleep(0.1)
        assert trimmer.trims == first + 1 and not trimmer.pending  # trimmed once, idle
        await asyncio.sleep(2.5)
        assert trimmer.trims == first + 1  # and not again while nothing runs
    finally:
        await engine.close()
