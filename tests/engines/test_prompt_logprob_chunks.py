"""Prompt logprobs never hold more than SCORED_CHUNK full-vocabulary rows of logits at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from prismgate.core.actions import PositionRange
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.hf.steps import SCORED_CHUNK
from tests.engines.requests import run


async def test_a_scored_prompt_runs_in_chunks_whose_logits_stay_small(tiny_model_dir: Path) -> None:
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
        assert max(rows) <= SCORED_CHUNK and len(rows) >= 300 // SCORED_CHUNK
        rows.clear()
        await run(engine, prompt, max_tokens=1)  # nothing scored: the prompt goes in one chunk
        assert len(rows) == 1
    finally:
        await engine.close()
