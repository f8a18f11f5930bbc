"""Request parsing and chat continuation, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from prismgate.codecs.openai.errors import OpenAIError
from prismgate.codecs.openai.request import parse_chat, parse_completion
from prismgate.core.chat import Message, TextPart, render
from prismgate.core.prompts import assistant_closer, render_continuation

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_defaults() -> None:
    req = parse_chat(dict(BASE))
    c = req.common
    assert (c.temperature, c.top_p, c.max_tokens, c.stream, c.top_logprobs, c.readouts) == (
        1.0,
        1.0,
        None,
        False,
        None,
        None,
    )
    assert req.messages[0].role == "user" and req.messages[0].text == "hi"


def test_aliases_and_folding() -> None:
    c = parse_chat({**BASE, "max_tokens": 5, "max_completion_tokens": 9, "seed": -1, "top_k": -1}).common
    assert c.max_tokens == 9 and c.seed == 2**63 - 1 and c.top_k == 0
    assert parse_chat({**BASE, "messages": [{"role": "developer", "content": "x"}]}).messages[0].role == "system"
    assert parse_chat({**BASE, "top_p": 0}).common.temperature == 0.0
    assert parse_chat({**BASE, "stream_options": {"include_usage": True}}).common.include_usage is False
    assert parse_chat({**BASE, "stream": True, "stream_options": {"include_usage": True}}).common.include_usage


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": None}, "model"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": 3}, "stop"),
        ({"logit_bias": {"1": 500}}, "logit_bias.1"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"readouts": {"layers": [0], "extra": 1}}, "readouts"),
        ({"stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
        ({"n": 2, "session_id": "s"}, "n"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"readouts": {"layers": ["0"]}}, "readouts.layers"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
            "messages[0].content[0].image_url.url",
        ),
    ],
)
def test_bad_chat_fields(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        parse_chat({**BASE, **patch})
    assert e.value.status == 400 and e.value.param == param


def test_image_data_url_becomes_an_image_part() -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    req = parse_chat(
        {
            **BASE,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}],
                }
            ],
        }
    )
    parts = req.messages[0].parts
    assert parts[1].mime == "image/png" and parts[1].data.startswith(b"\x89PNG")


def test_completion_prompts() -> None:
    assert parse_completion({"model": "m", "prompt": "x"}).prompt == "x"
    assert parse_completion({"model": "m", "prompt": ["x"]}).prompt == "x"
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}).prompt == (1, 2)
    for bad, param in [(["a", "b"], "prompt"), ([], "prompt"), (None, "prompt")]:
        with pytest.raises(OpenAIError) as e:
            parse_completion({"model": "m", "prompt": bad})
        assert e.value.param == param
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "m", "prompt": "x", "best_of": 3})
    assert e.value.param == "best_of"


async def test_continuation_equals_the_whole_rendering(tiny_service: Any) -> None:
    svc = tiny_service.models
    first = [Message("system", [TextPart("Be brief.")]), Message("user", [TextPart("Hi")])]
    timeline = list(render(svc, first).tokens)
    reply = svc.info().tokenizer.encode("Hello!")
    eos = svc.info().eos_token_ids[0]
    new = [Message("user", [TextPart("More?")])]
    whole = render(svc, [*first, Message("assistant", [TextPart("Hello!")]), *new]).tokens
    # a reply that ended on EOS, and one cut off by max_tokens, both continue into the same conversation
    for ending in ([eos], []):
        done = timeline + reply + ending
        cont = render_continuation(svc, done, new)
        assert done + list(cont.tokens) == list(whole)
    closer = assistant_closer(svc)
    assert closer[0] == eos
    assert render_continuation(svc, [], new).tokens == render(svc, new).tokens
