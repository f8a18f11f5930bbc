"""Structured outputs on the vLLM engine: vLLM's own grammar backend, the same answers as the transformers engine.

Both engines run the tiny model in float32; greedy decoding under one JSON schema must pick the
same tokens on both (xgrammar's mask in engines/hf/sampling.py on one side, vLLM's structured
outputs on the other), and the answer must validate.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from prismgate.codecs.openai.tools import Tools, parse_calls
from prismgate.core.errors import Code, GatewayError
from prismgate.core.structured import Kind, Structured, json_schema
from tests.engines.requests import run

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "lit": {"type": "boolean"},
        "colour": {"enum": ["red", "white", "black"]},
        "tags": {"type": "array", "items": {"enum": ["sea", "rock"]}, "maxItems": 3},
    },
    "required": ["lit", "colour", "tags"],
    "additionalProperties": False,
}


def prompt(engine: Any) -> tuple[int, ...]:
    return tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": "A lighthouse, as JSON."}]))


async def answer(engine: Any, structured: Structured, **spec: Any) -> tuple[list[int], str]:
    events, done = await run(engine, prompt(engine), max_tokens=80, structured=structured, **spec)
    assert done.finish_reason.name == "EOS", done
    ids = [e.id for e in events if not e.is_prefill]
    return ids, engine.info.tokenizer.decode(ids)


async def test_a_schema_gives_the_same_valid_json_on_both_engines(tiny_pair: Any) -> None:
    hf, vl = tiny_pair
    ids, text = await answer(hf, json_schema(SCHEMA))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert await answer(vl, json_schema(SCHEMA)) == (ids, text)


async def test_choice_and_regex_hold_on_vllm(tiny_pair: Any) -> None:
    _, vl = tiny_pair
    choices = ("yes", "no", "a keeper")
    for seed in range(3):
        _, text = await answer(vl, Structured(Kind.CHOICE, choices=choices), temperature=1.5, seed=seed)
        assert text in choices
    _, text = await answer(vl, Structured(Kind.REGEX, "[a-z]{3}-[0-9]{2}"))
    assert len(text) == 6 and text[3] == "-" and text[4:].isdigit()


async def test_an_invalid_regex_is_refused_by_vllm(tiny_pair: Any) -> None:
    _, vl = tiny_pair
    with pytest.raises(GatewayError) as caught:
        await run(vl, prompt(vl), max_tokens=4, structured=Structured(Kind.REGEX, "(unclosed"))
    assert caught.value.code is Code.INVALID_ARGUMENT


async def test_a_tool_call_grammar_is_the_same_on_both_engines(tiny_pair: Any) -> None:
    """tool_choice with a named function: a Lark grammar around a JSON schema (codecs/openai/tools.py)."""
    hf, vl = tiny_pair
    time = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
    tools = Tools(({"type": "function", "function": {"name": "get_time", "parameters": time}},), "get_time")
    constraint = tools.constraint
    assert constraint is not None
    ids, text = await answer(hf, constraint)
    _, calls = parse_calls(text)
    assert [c.name for c in calls] == ["get_time"] and json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
    assert await answer(vl, constraint) == (ids, text)
