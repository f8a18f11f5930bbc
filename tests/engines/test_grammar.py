"""The transformers engine's grammars (engines/hf/grammar.py): compile bounds, the byte-bounded cache, the mask."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from prismgate.core.structured import GrammarRefused, Kind, Structured, json_schema
from prismgate.engines.hf.grammar import Grammars


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def grammars(tokenizer: Any, **kwargs: Any) -> Grammars:
    options = {"cache_bytes": 1 << 20, "timeout_s": 30.0, **kwargs}
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id], **options)


@pytest.mark.asyncio
async def test_the_mask_allows_exactly_what_continues_the_grammar(tokenizer: Any) -> None:
    g = grammars(tokenizer)
    constraint = await g.compile(Structured(Kind.CHOICE, choices=("ab", "ac")))
    logits = torch.zeros(len(tokenizer))
    allowed = torch.isfinite(constraint.mask(logits)).nonzero().flatten().tolist()
    assert [tokenizer.decode([t]) for t in allowed] == ["a"]  # a byte-level vocabulary: one byte per token
    constraint.accept(allowed[0])
    allowed = torch.isfinite(constraint.mask(logits)).nonzero().flatten().tolist()
    assert sorted(tokenizer.decode([t]) for t in allowed) == ["b", "c"]
    constraint.accept(tokenizer.convert_tokens_to_ids("b"))
    assert not constraint.done
    allowed = torch.isfinite(constraint.mask(logits)).nonzero().flatten().tolist()
    assert allowed == [tokenizer.eos_token_id]  # complete: only the end of the turn
    constraint.accept(tokenizer.eos_token_id)
    assert constraint.done
    g.close()


@pytest.mark.asyncio
async def test_a_refused_or_slow_compile_is_an_invalid_argument(tokenizer: Any) -> None:
    g = grammars(tokenizer)
    with pytest.raises(GrammarRefused, match="invalid json_schema constraint"):
        await g.compile(json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}))
    slow = grammars(tokenizer, timeout_s=1e-6)  # no compile ends within a microsecond
    with pytest.raises(GrammarRefused, match="grammar_compile_timeout_s"):
        await slow.compile(json_schema({"type": "object", "properties": {"b": {"type": "integer"}}}))
    g.close()
    slow.close()


@pytest.mark.asyncio
async def test_a_compile_that_ends_late_while_the_loop_is_busy_is_still_refused(tokenizer: Any) -> None:
    """The compile ends in its thread while the loop is blocked past the limit: when the loop wakes,
    the compile's result is ready before the timer, and it must not slip through (a busy machine)."""
    import time

    g = grammars(tokenizer, timeout_s=0.2)
    await g.compile(Structured(Kind.REGEX, "[a-z]+"))  # builds the tokenizer: the next compile is quick
    asyncio.get_running_loop().call_soon(time.sleep, 0.5)  # the loop stalls right after the compile starts
    with pytest.raises(GrammarRefused, match="grammar_compile_timeout_s"):
        await g.compile(Structured(Kind.REGEX, "[0-9]+"))
    g.close()


@pytest.mark.asyncio
async def test_the_cache_stays_within_its_bytes(tokenizer: Any) -> None:
    g = grammars(tokenizer, cache_bytes=4096)
    for i in range(40):
        schema = {"type": "object", "properties": {f"key{i}": {"enum": [f"v{j}" for j in range(i % 7 + 1)]}}}
        await g.compile(json_schema(schema))
        count, size = g.cached
        assert size <= 4096
    assert 0 < count < 40  # kept some, dropped the oldest
    last = json_schema({"type": "object", "properties": {"key39": {"enum": [f"v{j}" for j in range(39 % 7 + 1)]}}})
    before = g.cached
    await g.compile(last)  # the most recent one is a hit: nothing added
    assert g.cached == before
    none = grammars(tokenizer, cache_bytes=0)
    await none.compile(Structured(Kind.REGEX, "[a-z]+"))
    assert none.cached == (0, 0)
    g.close()
    none.close()


def test_the_compiled_json_is_compact(tokenizer: Any) -> None:
    """No whitespace between JSON tokens: the same JSON on both engines, and no free-running spaces."""
    from prismgate.engines.hf.grammar import _translate

    grammar = json.loads(_translate(Structured(Kind.JSON_OBJECT)))
    assert grammar["grammars"][0]["json_schema"]["x-guidance"]["whitespace_flexible"] is False
