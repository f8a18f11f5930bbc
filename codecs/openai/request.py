"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions``, validated.

Policy on fields (documented in docs/openai.md):

* fields this server implements (OpenAI's, vLLM's sampling extensions, prismgate's own)
  are type- and range-checked, and a bad one is a 400 whose ``param`` names it;
* OpenAI and vLLM fields that would change the output but are not implemented here
  (tools, beam search, ...) are a 400 saying so, never silently dropped: a
  client must not get an answer to a question it did not ask (:mod:`.unimplemented`);
* fields that do not change the output (``user``, ``metadata``, ``priority``, ...) are
  ignored, and so are fields nobody defined, as OpenAI does, so that newer clients keep
  working; an unknown name is logged once per process.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prismgate.codecs.binary_numbers import BadEncoding, read_encoding
from prismgate.codecs.openai.errors import bad_request
from prismgate.codecs.openai.features import parse_features
from prismgate.codecs.openai.fields import get_bool, get_float, get_int, get_object, get_str
from prismgate.codecs.openai.structured import read_structured
from prismgate.codecs.openai.tools import Tools, read_calls, read_tools
from prismgate.codecs.openai.unimplemented import check_fields
from prismgate.core.actions import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from prismgate.core.chat import ImagePart, Message, Part, TextPart, ToolCall
from prismgate.core.features import FeatureSpec
from prismgate.core.structured import Structured

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n
INT64 = 2**63

# the fields each endpoint reads (the rest: .unimplemented)
_COMMON_FIELDS = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "seed",
        "deterministic", "stop", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
        "response_format", "structured_outputs", "logprobs", "logprobs_encoding_format", "logprobs_dtype",
        "readouts", "features", "session_id", "steering",
    }
)  # fmt: skip
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "modalities",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}

# role on the wire -> role given to the chat template
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+);base64,(.*)$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ReadoutRequest:
    """``"readouts"``: which manifest layers (model layer numbers) and concepts (names); None means all.

    ``binary``: the dtype of the base64 form (``encoding_format: "base64"``), None for JSON numbers.
    """

    layers: tuple[int, ...] | None
    concepts: tuple[str, ...] | None
    binary: np.dtype | None = None


@dataclass(frozen=True, slots=True)
class Sampling:
    """vLLM's sampling extensions (and OpenAI's penalties and ``logit_bias``), with vLLM's meaning."""

    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0


@dataclass(frozen=True, slots=True)
class Common:
    """What chat and text completions share."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    deterministic: bool | None  # None: the server's default
    stop: tuple[str, ...]
    n: int  # choices, each its own generation of the same prompt
    sampling: Sampling
    top_logprobs: int | None  # None: no logprobs; otherwise how many alternatives per token
    logprobs_binary: np.dtype | None  # logprobs as base64 of this dtype (prismgate.logprobs); None: OpenAI's form
    readouts: ReadoutRequest | None
    features: FeatureSpec | None  # SAE features per token (codecs/openai/features.py)
    session_id: str | None
    steering: Any  # the raw "steering" list: read in the plan, against the service's request budget
    structured: Structured | None = None  # response_format / structured_outputs: the grammar the answer follows
    structured_param: str = "response_format"  # the field it came from, for errors


@dataclass(frozen=True, slots=True)
class ChatRequest:
    common: Common
    messages: tuple[Message, ...]
    tools: Tools | None = None  # functions the model may call (tool_choice "none": None)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    common: Common
    prompt: str | tuple[int, ...]
    echo: bool


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    check_fields(body, CHAT_FIELDS, chat=True)
    _reject_unsupported(body, chat=True)
    logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    max_tokens = get_int(body, "max_completion_tokens", None, lo=0)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, lo=0)
    common = _common(body, max_tokens, (top or 0) if logprobs else None)
    tools = read_tools(body)
    if tools is not None and common.session_id is not None:
        raise bad_request("'tools' cannot be combined with 'session_id' on this server", "tools")
    if tools is not None and tools.constraint is not None and common.structured is not None:
        raise bad_request(
            f"'tool_choice' {tools.choice!r} constrains the answer to calls: it cannot be combined with "
            f"'{common.structured_param}'",
            "tool_choice",
        )
    return ChatRequest(common, _messages(body.get("messages")), tools)


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    check_fields(body, COMPLETION_FIELDS, chat=False)
    _reject_unsupported(body, chat=False)
    top = get_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if body.get("suffix"):
        raise bad_request("'suffix' (insertion) is not supported by this server", "suffix")
    best_of = get_int(body, "best_of", 1, lo=1)
    if best_of != 1:
        raise bad_request("only best_of=1 is supported by this server", "best_of")
    common = _common(body, get_int(body, "max_tokens", None, lo=0), top)
    return CompletionRequest(common, _prompt(body.get("prompt")), get_bool(body, "echo", False))


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _common(body: Mapping[str, Any], max_tokens: int | None, top_logprobs: int | None) -> Common:
    model = get_str(body, "model", required=True)
    assert model is not None
    stream = get_bool(body, "stream", False)
    options = get_object(body, "stream_options") or {}
    include_usage = get_bool(options, "include_usage", False, path="stream_options.include_usage")
    if get_bool(options, "continuous_usage_stats", False, path="stream_options.continuous_usage_stats"):
        raise bad_request(
            "'stream_options.continuous_usage_stats' is not supported by this server (usage comes in the last chunk)",
            "stream_options.continuous_usage_stats",
        )
    n = get_int(body, "n", 1, lo=1, hi=MAX_CHOICES)
    assert n is not None
    if n > 1 and body.get("session_id") is not None:
        raise bad_request("a session turn has one answer: 'n' must be 1 with 'session_id'", "n")
    temperature = get_float(body, "temperature", 1.0, lo=0.0, hi=2.0)
    top_p = get_float(body, "top_p", 1.0, lo=0.0, hi=1.0)
    top_k = get_int(body, "top_k", 0, lo=-1)
    seed = get_int(body, "seed", None, lo=-INT64, hi=INT64 - 1)
    deterministic = get_bool(body, "deterministic", None)
    logprobs_binary = _logprobs_encoding(body, top_logprobs)
    if top_p == 0.0:  # OpenAI accepts 0: only the most likely token survives, which is greedy decoding
        temperature, top_p = 0.0, 1.0
    return Common(
        model=model,
        stream=stream,
        include_usage=stream and include_usage,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(0, top_k or 0),  # -1 (vLLM's "off") is 0 here
        seed=None if seed is None else seed % INT64,  # int64 seeds fold into the engine's [0, 2**63)
        deterministic=deterministic,
        stop=_stop(body.get("stop")),
        n=n,
        sampling=_sampling(body, max_tokens),
        top_logprobs=top_logprobs,
        logprobs_binary=logprobs_binary,
        readouts=_readouts(body.get("readouts")),
        features=parse_features(body.get("features")),
        session_id=get_str(body, "session_id"),
        steering=body.get("steering"),
        structured=read_structured(body),
        structured_param="structured_outputs" if body.get("structured_outputs") is not None else "response_format",
    )


def _sampling(body: Mapping[str, Any], max_tokens: int | None) -> Sampling:
    """vLLM's sampling fields, range-checked as vLLM checks them."""
    min_tokens = get_int(body, "min_tokens", 0, lo=0)
    assert min_tokens is not None
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    repetition = get_float(body, "repetition_penalty", 1.0, lo=0.0, hi=2.0)
    if repetition == 0.0:
        raise bad_request("'repetition_penalty' must be in (0, 2], got 0", "repetition_penalty")
    return Sampling(
        ignore_eos=get_bool(body, "ignore_eos", False),
        min_tokens=min_tokens,
        stop_token_ids=_token_ids(body.get("stop_token_ids"), "stop_token_ids"),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
        presence_penalty=get_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=repetition,
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_p=get_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
    )


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad_request(f"'{name}' must be an array of token ids (integers >= 0)", name)
    return tuple(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}``, biases in [-100, 100] (the token ids are checked against the vocabulary later)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out: list[tuple[int, float]] = []
    for key in value:
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key[:32]!r}", "logit_bias")
        where = f"logit_bias.{key}"
        out.append((int(key), get_float(value, key, 0.0, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS, path=where)))
    return tuple(out)


def _reject_unsupported(body: Mapping[str, Any], *, chat: bool) -> None:
    if not chat:
        return
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("only the 'text' modality is supported by this server", "modalities")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if any(s == "" for s in items):
        raise bad_request("'stop' strings must not be empty", "stop")
    return tuple(items)


def _logprobs_encoding(body: Mapping[str, Any], top_logprobs: int | None) -> np.dtype | None:
    """``logprobs_encoding_format`` / ``logprobs_dtype``: base64 logprobs, for a request that asks for logprobs."""
    try:
        encoding, dtype = body.get("logprobs_encoding_format"), body.get("logprobs_dtype")
        binary = read_encoding(encoding, dtype, "logprobs_encoding_format", "logprobs_dtype")
    except BadEncoding as exc:
        raise bad_request(exc.message, exc.field) from None
    if binary is not None and top_logprobs is None:
        raise bad_request(
            "'logprobs_encoding_format': 'base64' needs logprobs ('logprobs': true in chat, a number in completions)",
            "logprobs_encoding_format",
        )
    return binary


def _readouts(value: Any) -> ReadoutRequest | None:
    if value is None or value is False:
        return None
    if value is True:
        return ReadoutRequest(None, None)
    if not isinstance(value, dict):
        raise bad_request('\'readouts\' must be true or an object {"layers": [...], "concepts": [...]}', "readouts")
    layers = value.get("layers")
    if layers is not None and (
        not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    ):
        raise bad_request("'readouts.layers' must be an array of layer numbers", "readouts.layers")
    concepts = value.get("concepts")
    if concepts is not None and (not isinstance(concepts, list) or not all(isinstance(x, str) for x in concepts)):
        raise bad_request("'readouts.concepts' must be an array of concept names", "readouts.concepts")
    unknown = sorted(set(value) - {"layers", "concepts", "encoding_format", "dtype"})
    if unknown:
        raise bad_request(
            f"'readouts' has unknown keys {unknown}; it takes 'layers', 'concepts', 'encoding_format' and 'dtype'",
            "readouts",
        )
    try:
        binary = read_encoding(
            value.get("encoding_format"), value.get("dtype"), "readouts.encoding_format", "readouts.dtype"
        )
    except BadEncoding as exc:
        raise bad_request(exc.message, exc.field) from None
    return ReadoutRequest(
        None if layers is None else tuple(layers), None if concepts is None else tuple(concepts), binary
    )


def _messages(value: Any) -> tuple[Message, ...]:
    if value is None:
        raise bad_request("you must provide a 'messages' parameter", "messages")
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty array of messages", "messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))


def _message(value: Any, where: str) -> Message:
    if not isinstance(value, dict):
        raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
    role = value.get("role")
    if role not in _ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
    if value.get("function_call"):
        raise bad_request(f"'{where}.function_call' (the legacy form) is not supported: use 'tool_calls'", where)
    calls: tuple[ToolCall, ...] = ()
    if value.get("tool_calls"):
        if role != "assistant":
            raise bad_request(f"'{where}.tool_calls' is for assistant messages", f"{where}.tool_calls")
        calls = read_calls(value["tool_calls"], f"{where}.tool_calls")
    call_id = None
    if role == "tool":
        call_id = get_str(value, "tool_call_id", required=True, path=f"{where}.tool_call_id")
    content = _content(value.get("content"), "assistant" if calls else role, f"{where}.content")
    return Message(_ROLES[role], content, tool_calls=calls, tool_call_id=call_id)


def _content(value: Any, role: str, where: str) -> list[Part]:
    """A string, or an array of text and image parts in order."""
    if value is None:
        if role == "assistant":
            return [TextPart("")]
        raise bad_request(f"'{where}' is required for {role} messages", where)
    if isinstance(value, str):
        return [TextPart(value)]
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or an array of content parts", where)
    parts: list[Part] = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{where}[{j}]"
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(TextPart(part["text"]))
        elif kind == "image_url" and role == "user":
            parts.append(_image(part.get("image_url"), f"{at}.image_url"))
        else:
            raise bad_request(
                f"'{at}' must be a text part {{'type': 'text', 'text': ...}}"
                + (" or (in user messages) an image_url part" if role == "user" else "")
                + f"; got type {kind!r}",
                at,
            )
    return parts


def _image(value: Any, where: str) -> ImagePart:
    """An ``image_url`` part: only inline ``data:`` URLs (this server fetches nothing)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise bad_request(f"'{where}.url' must be a string", f"{where}.url")
    match = _DATA_URL.match(url)
    if match is None:
        raise bad_request(
            f"'{where}.url' must be a base64 data URL (data:image/png;base64,...); this server does not fetch URLs",
            f"{where}.url",
        )
    try:
        data = base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"'{where}.url' holds invalid base64", f"{where}.url") from None
    return ImagePart(data=data, mime=match.group(1))


def _prompt(value: Any) -> str | tuple[int, ...]:
    """A string, an array of token ids, or a one-element array of either."""
    if value is None:
        raise bad_request("you must provide a 'prompt' parameter", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise bad_request("only one prompt per request is supported by this server", "prompt")
    raise bad_request("'prompt' must be a string, an array of token ids, or a one-element array of either", "prompt")


def select(items: Sequence[Any], wanted: Sequence[Any] | None, what: str, param: str) -> tuple[int, ...]:
    """Indices of ``wanted`` in ``items`` (all of them when None); unknown names are a 400."""
    if wanted is None:
        return tuple(range(len(items)))
    index = {v: i for i, v in enumerate(items)}
    missing = [w for w in wanted if w not in index]
    if missing:
        raise bad_request(f"unknown {what} {missing}; the readout manifest has {list(items)}", param)
    if not wanted:
        raise bad_request(f"'{param}' must not be empty (leave it out to get all {what})", param)
    return tuple(index[w] for w in wanted)
