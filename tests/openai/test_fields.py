"""Every field of vLLM's chat and completion requests: honoured, refused with a 400 naming it, or ignored.

docs/openai.md's table says which; these tests hold the code to it, field by field, without a
server. ``VLLM_CHAT`` and ``VLLM_COMPLETION`` are the fields of vLLM's ``ChatCompletionRequest``
and ``CompletionRequest`` (vllm/entrypoints/openai/chat_completion/protocol.py and
completion/protocol.py).
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from prismgate.codecs.openai.errors import OpenAIError
from prismgate.codecs.openai.request import CHAT_FIELDS, COMPLETION_FIELDS, parse_chat, parse_completion

DOC = Path(__file__).parents[2] / "docs" / "openai.md"

_VLLM_BOTH = [
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_special_tokens",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
]
VLLM_CHAT = [
    *_VLLM_BOTH,
    "messages",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "include_reasoning",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "return_prompt_text",
]
VLLM_COMPLETION = [*_VLLM_BOTH, "prompt", "suffix", "prompt_embeds"]

# a value of each refused field that asks for something
ASKING: dict[str, Any] = {
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
    "suffix": "end",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "watermarking": True,
    "skip_special_tokens": False,
    "truncate_prompt_tokens": 10,
    "truncation_side": "left",
    "prompt_logprobs": 1,
    "logprob_token_ids": [1],
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "structured_outputs": {"regex": "a+"},
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "vllm_xargs": {"k": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "thinking_token_budget": 10,
    "reasoning_effort": "low",
    "include_reasoning": False,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "add_special_tokens": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1},
    "return_prompt_text": True,
    "prompt_embeds": "AAAA",
    "functions": [{"name": "f"}],
    "function_call": "f",
    "audio": {"voice": "x"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "verbosity": "low",
    "modalities": ["text", "audio"],
    "best_of": 2,
}
# ... and one that asks for nothing (beside null and empty), accepted
NEUTRAL: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "skip_special_tokens": True,
    "thinking_token_budget": -1,
    "include_reasoning": True,
    "add_generation_prompt": True,
    "add_special_tokens": False,
    "echo": False,
    "tool_choice": "none",
}


def table() -> dict[tuple[str, str], str]:
    """(field, "chat" | "completions") -> "honoured" | "refused" | "ignored", from the docs' table."""
    text = DOC.read_text()
    section = text[text.index("### Every field of vLLM's requests") :]
    out: dict[tuple[str, str], str] = {}
    for names, endpoint, status in re.findall(r"^\| ((?:`\w+`(?:, )?)+) \| (\w+) \| (\w+) \|", section, re.M):
        for name in re.findall(r"`(\w+)`", names):
            for e in ("chat", "completions") if endpoint == "both" else (endpoint,):
                assert (name, e) not in out, f"{name} ({e}) is listed twice"
                out[(name, e)] = status
    return out


def parse(endpoint: str, extra: dict[str, Any]) -> Any:
    if endpoint == "chat":
        return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
    return parse_completion({"model": "m", "prompt": "hi", **extra})


def rows(status: str) -> list[tuple[str, str]]:
    return sorted(k for k, v in table().items() if v == status)


def test_the_table_lists_every_field_of_vllms_requests() -> None:
    listed = table()
    assert set(listed.values()) == {"honoured", "refused", "ignored"}
    missing = [f"{f} (chat)" for f in VLLM_CHAT if (f, "chat") not in listed]
    missing += [f"{f} (completions)" for f in VLLM_COMPLETION if (f, "completions") not in listed]
    assert not missing, f"docs/openai.md does not say what happens to {missing}"


@pytest.mark.parametrize(("name", "endpoint"), rows("honoured"))
def test_honoured_fields_are_read(name: str, endpoint: str) -> None:
    assert name in (CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS)


@pytest.mark.parametrize(("name", "endpoint"), rows("refused"))
def test_refused_fields_are_a_400_naming_them(name: str, endpoint: str) -> None:
    with pytest.raises(OpenAIError) as e:
        parse(endpoint, {name: ASKING[name]})
    assert e.value.status == 400 and e.value.param == name
    for nothing in (None, NEUTRAL.get(name)):  # a field that asks for nothing is accepted
        parse(endpoint, {name: nothing})


@pytest.mark.parametrize(("name", "endpoint"), rows("ignored"))
def test_ignored_fields_are_accepted_silently(name: str, endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="prismgate.codecs.openai.unimplemented"):
        parse(endpoint, {name: {"any": ["value"]}})
    assert not caplog.records


def test_unknown_fields_are_ignored_and_logged_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    name = f"future_field_{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.WARNING, logger="prismgate.codecs.openai.unimplemented"):
        for endpoint in ("chat", "completions", "chat"):
            parse(endpoint, {name: 1, "user": "u"})
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and name in logged[0]


def test_the_unknown_names_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    from prismgate.codecs.openai import unimplemented

    fields = unimplemented.UnknownFields()
    names = [f"n{i}" for i in range(unimplemented.MAX_LOGGED_NAMES + 50)]
    with caplog.at_level(logging.WARNING, logger="prismgate.codecs.openai.unimplemented"):
        fields.note(names, "/v1/completions")
        fields.note(["another"], "/v1/completions")
    assert len(caplog.records) == unimplemented.MAX_LOGGED_NAMES + 1  # and one line saying the rest go unlogged
    assert len(fields._seen) == unimplemented.MAX_LOGGED_NAMES
