"""bench/vs_vllm.py fails a round that did not do the work it asked for, whichever client measured it."""

from __future__ import annotations

from typing import Any

from bench.clients import StreamResult
from bench.vllm_bench import problems
from bench.vs_vllm import wrong_lengths


def stream(usage_tokens: int | None) -> StreamResult:
    return StreamResult(0.01, [0.01, 0.02], 2, usage_tokens=usage_tokens)


def test_a_round_passes_only_when_every_answer_has_the_asked_length_by_the_servers_count() -> None:
    assert wrong_lengths([stream(8), stream(8)], 8) is None
    assert "[8, 5]" in (wrong_lengths([stream(8), stream(5)], 8) or "")  # one answer ended early
    assert "None" in (wrong_lengths([stream(8), stream(None)], 8) or "")  # no usage: not counted, not trusted


def client_result(**changes: Any) -> dict[str, Any]:
    """What vLLM's client returns for 4 prompts of 8 tokens, all well, with ``changes``."""
    result = {"completed": 4, "failed": 0, "errors": [""] * 4, "output_lens": [8] * 4, "total_output_tokens": 32}
    return result | changes


def test_a_vllm_client_run_passes_only_when_complete_and_every_answer_has_the_asked_length() -> None:
    assert problems(client_result(), 4, 8) == []
    failed = problems(client_result(completed=3, failed=1, errors=["", "HTTP 400", "", ""]), 4, 8)
    assert any("1 failed" in p and "HTTP 400" in p for p in failed)
    # the total can hide one short and one long answer: each answer is checked
    assert any("[7, 8, 9]" in p for p in problems(client_result(output_lens=[8, 7, 9, 8]), 4, 8))
    assert any("28 output tokens" in p for p in problems(client_result(total_output_tokens=28), 4, 8))
