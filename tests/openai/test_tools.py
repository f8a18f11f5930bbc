"""Tools on the OpenAI API: a tiny model whose chat template declares tool use (Hermes style), the official client.

The model's random weights never choose a call by themselves: ``tool_choice`` ``required`` and a
named function hold the answer to ``<tool_call>`` blocks by grammar, and the parser turns them
into ``tool_calls``; ``auto`` parsing is checked on the parser itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from prismgate.codecs.openai.tools import CallStream, parse_calls
from tests.conftest import LiveServer, run_server, tiny_settings
from tests.tiny_model import build_tiny_llama

TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (its weights: the same seed) with 2k of context and a chat template that declares tool use."""
    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny-tools"), max_len=2048)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def tool_server(tool_model: Path, tiny_pack: Path) -> Iterator[LiveServer]:
    with run_server(tiny_settings(tool_model, tiny_pack)) as server:
        yield server


@pytest.fixture(scope="module")
def tool_client(tool_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tool_server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def check_calls(calls: Any, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_answer_with_calls(tool_client: openai.OpenAI, model: str) -> None:
    for seed in range(3):
        r = tool_client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,  # one call: random weights would append calls to max_tokens
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = tool_client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0, max_tokens=200
    )
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, only="get_time")


def test_calls_stream_as_tool_call_deltas(tool_client: openai.OpenAI, model: str) -> None:
    with tool_client.chat.completions.stream(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.8,
        seed=5,
        max_tokens=200,
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [t for c in chunks for ch in c.choices for t in (ch.delta.tool_calls or [])]
    assert deltas and all(d.index is not None for d in deltas)
    assert "<tool_call>" not in "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert final.choices[0].finish_reason == "tool_calls"
    check_calls(final.choices[0].message.tool_calls)


def test_tool_results_go_back_in_the_next_turn(
    tool_client: openai.OpenAI, tool_server: LiveServer, tool_model: Path, model: str
) -> None:
    first = tool_client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    turn = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sun"}'},
    ]
    second = tool_client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=4, temperature=0)
    # the prompt is the template's rendering of the call (its arguments as an object) and of the result
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    rendered = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        turn[2],
    ]
    text = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert call.function.name in text and "<tool_response>" in text
    assert second.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    body = {"model": model, "messages": turn, "max_tokens": 1}
    r = httpx.post(tool_server.http_url + "/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text


def test_a_template_without_tools_refuses_them(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=4)
    turn = [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        client.chat.completions.create(model=model, messages=turn, max_tokens=4)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters, digits"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ],
)
def test_bad_tool_requests_are_400s(tool_server: LiveServer, model: str, extra: dict[str, Any], words: str) -> None:
    body = {"model": model, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(tool_server.http_url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_the_parser_finds_hermes_calls_in_any_split() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"})
    ]
    assert parse_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    for size in (1, 2, 3, 7):  # streamed in pieces of any size: the same content and calls
        stream = CallStream()
        shown, found = "", []
        for i in range(0, len(text), size):
            piece, calls = stream.feed(text[i : i + size])
            shown += piece
            found += calls
        shown += stream.flush()
        assert shown.strip() == "Let me check." and [c.name for c in found] == ["get_time"]
