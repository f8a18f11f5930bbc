"""vLLM and transformers on the same weights give the same tokens, logprobs and readouts.

vLLM runs with its default compilation (on CPU: Dynamo traced once, Inductor), so the
readouts come from the compiled graph. Both engines run float32 on CPU, so what differs is
only kernels and summation order. Tolerances, with the largest differences measured here
under compilation (tiny model / SmolLM2-135M):

* greedy tokens: identical;
* logprobs (prompt and decode, and the top-k values): ``|vllm - hf| <= 1e-3`` nats
  (measured 2.6e-6 / 3.7e-5);
* readouts: ``|vllm - hf| <= 1e-3 * max(1, |hf|)`` (measured 2.1e-6 / 1.4e-4); relative
  because readouts scale with the residual stream, which grows with depth in real models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prismgate.core.actions import PositionRange
from prismgate.core.events import TokenEvent
from tests.engines.requests import run
from tests.engines.vllm_factory import make_vllm_engine, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

LOGPROB_TOL = 1e-3
READOUT_RTOL = 1e-3


async def pair(model_dir: Path, pack: Path | None, model_id: str) -> tuple[Any, Any]:
    require_vllm()
    from prismgate.engines.hf import TransformersEngine

    hf = TransformersEngine(model_dir, model_id=model_id, concept_pack=pack, threads=1, dtype="float32")
    vl = make_vllm_engine(model_dir, model_id=model_id, concept_pack=pack)
    await hf.start()
    await vl.start()
    return hf, vl


def assert_compiled(vl: Any) -> None:
    """The engine ran under vLLM's default compilation, not eagerly: the graph computed the readouts."""
    from vllm.config import CompilationMode

    config = vl._llm.vllm_config
    assert not config.model_config.enforce_eager
    assert config.compilation_config.mode != CompilationMode.NONE


def compare(hf_events: list[TokenEvent], vl_events: list[TokenEvent]) -> dict[str, float]:
    assert [(e.position, e.id, e.is_prefill) for e in vl_events] == [
        (e.position, e.id, e.is_prefill) for e in hf_events
    ]
    worst = {"logprob": 0.0, "top": 0.0, "readout": 0.0}
    for a, b in zip(hf_events, vl_events, strict=True):
        assert (a.logprob is None) == (b.logprob is None), a.position
        if a.logprob is not None and b.logprob is not None:
            worst["logprob"] = max(worst["logprob"], abs(a.logprob - b.logprob))
        if a.top_logprobs is not None:
            assert b.top_logprobs is not None and len(b.top_logprobs) == len(a.top_logprobs)
            for (ia, va), (ib, vb) in zip(a.top_logprobs, b.top_logprobs, strict=True):
                worst["top"] = max(worst["top"], abs(va - vb))
                if ia != ib:  # a near-tie may swap order: then both values must still agree
                    assert abs(va - vb) <= LOGPROB_TOL
        assert (a.readout is None) == (b.readout is None), a.position
        if a.readout is not None and b.readout is not None:
            scale = np.maximum(1.0, np.abs(a.readout))
            worst["readout"] = max(worst["readout"], float(np.max(np.abs(a.readout - b.readout) / scale)))
    assert worst["logprob"] <= LOGPROB_TOL and worst["top"] <= LOGPROB_TOL, worst
    assert worst["readout"] <= READOUT_RTOL, worst
    return worst


async def test_tiny_model_agrees_with_transformers(tiny_pair: Any) -> None:
    hf, vl = tiny_pair
    p = tuple(hf.info.tokenizer.render_chat([{"role": "user", "content": "cross-check the engines"}]))
    n = len(p)
    spec = {
        "max_tokens": 16,
        "ignore_eos": True,
        "logprob_ranges": (PositionRange(0, n + 16),),
        "logprob_top_k": 5,
        "readout_ranges": (PositionRange(0, n + 16),),
    }
    hf_events, hf_done = await run(hf, p, **spec)
    vl_events, vl_done = await run(vl, p, **spec)
    assert_compiled(vl)
    assert hf_done.completion_tokens == vl_done.completion_tokens == 16
    worst = compare(hf_events, vl_events)
    print("tiny-llama worst differences:", worst)


@pytest.mark.slow
async def test_smollm2_agrees_with_transformers() -> None:
    require_vllm()
    from prismgate.compose import DEFAULT_PACK
    from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path

    pack = DEFAULT_PACK if DEFAULT_PACK.exists() else None
    hf, vl = await pair(default_model_path(), pack, DEFAULT_MODEL_ID)
    try:
        chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        p = tuple(hf.info.tokenizer.render_chat(chat))
        n = len(p)
        spec: dict[str, Any] = {
            "max_tokens": 24,
            "logprob_ranges": (PositionRange(n - 8, n + 24),),
            "logprob_top_k": 3,
        }
        if pack is not None:
            spec["readout_ranges"] = (PositionRange(n - 8, n + 24),)
        hf_events, hf_done = await run(hf, p, **spec)
        vl_events, vl_done = await run(vl, p, **spec)
        assert_compiled(vl)
        text = vl.info.tokenizer.decode([e.id for e in vl_events if not e.is_prefill])
        assert "Paris" in text
        assert vl_done.finish_reason == hf_done.finish_reason and vl_done.finish_reason.value == "eos"
        worst = compare(hf_events, vl_events)
        print("SmolLM2 worst differences:", worst, "answer:", text)
    finally:
        await vl.close()
        await hf.close()
