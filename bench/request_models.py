"""Per-request CPU to turn an OpenAI request body into the codec's validated request, three ways.

``hand-written``: the server's ``json_input.loads`` then ``parse_chat`` / ``parse_completion``.
``msgspec``: a prototype, msgspec Structs for types and shapes, then the same range checks and
rules in Python, the same codec objects out, the field policy fed by a second, lazy decode of
the top-level names (a Struct drops unknown ones); forms the shapes never reach (images, named
``tool_choice``) are left out of it, which favours it slightly. ``pydantic``: a floor only,
``TypeAdapter.validate_json`` over the same shapes as TypedDicts (when pydantic is installed).
The other floors show where the time goes. Rounds alternate the order; ratios to
``hand-written`` are per round, then medians and spread over rounds.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from typing_extensions import TypedDict  # pydantic needs it on Python < 3.12

from bench.common import median, table, write_results
from prismgate.codecs import json_input
from prismgate.codecs.openai.errors import bad_request
from prismgate.codecs.openai.features import parse_features
from prismgate.codecs.openai.request import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    INT64,
    MAX_CHOICES,
    ChatRequest,
    Common,
    CompletionRequest,
    Sampling,
    _logit_bias,
    _logprobs_encoding,
    _prompt,
    _readouts,
    _stop,
    parse_chat,
    parse_completion,
)
from prismgate.codecs.openai.structured import read_structured
from prismgate.codecs.openai.tools import Tools
from prismgate.codecs.openai.unimplemented import CHAT_REFUSED, COMPLETION_REFUSED, check_fields
from prismgate.core.actions import MAX_TOP_LOGPROBS
from prismgate.core.budget import RequestBudget
from prismgate.core.chat import Message, Part, TextPart

BUDGET = RequestBudget()
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"],
}
SHAPES: dict[str, tuple[bool, dict[str, Any]]] = {
    "short chat": (True, {"model": "m", "messages": [{"role": "user", "content": "Hello, who are you?"}]}),
    "chat + sampling, logprobs, readouts, steering": (
        True,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three rivers in Europe."},
            ],
            "max_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "seed": 1234,
            "stop": ["\n\n"],
            "presence_penalty": 0.1,
            "repetition_penalty": 1.1,
            "min_p": 0.05,
            "logit_bias": {"42": -5.0},
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 5,
            "readouts": {"layers": [1, 2], "concepts": ["honesty"]},
            "steering": [{"concept": "honesty", "strength": 2.0}],
            "user": "someone",
        },
    ),
    "completion, token-id prompt": (
        False,
        {"model": "m", "prompt": list(range(100, 228)), "max_tokens": 16, "temperature": 0, "logprobs": 2},
    ),
    "chat + json_schema + tools": (
        True,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
            "tools": [
                {
                    "type": "function",
                    "function": {"name": f"tool_{i}", "description": "Look something up.", "parameters": SCHEMA},
                }
                for i in range(3)
            ],
            "tool_choice": "auto",
        },
    ),
}


# -- the msgspec prototype: Structs for types and shapes ------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextIn(msgspec.Struct, tag="text"):
    text: str


class ImageURL(msgspec.Struct):
    url: str


class ImageIn(msgspec.Struct, tag="image_url"):
    image_url: ImageURL | str


class CallFunction(msgspec.Struct):
    name: str
    arguments: str


class CallIn(msgspec.Struct):
    id: str
    function: CallFunction
    type: str = "function"


class MessageIn(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextIn | ImageIn] | None = None
    tool_calls: list[CallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolIn(msgspec.Struct, tag="function"):
    function: FunctionDef


class ReadoutsIn(msgspec.Struct, forbid_unknown_fields=True):
    layers: list[int] | None = None
    concepts: list[str] | None = None
    encoding_format: str | None = None
    dtype: str | None = None


class Body(msgspec.Struct):
    """What both endpoints read; ranges are not here (they stay in Python, as in the codec)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | float | None = None  # 3.0 is 3, as get_int takes it
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    deterministic: bool | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    logprobs_encoding_format: str | None = None
    logprobs_dtype: str | None = None
    readouts: bool | ReadoutsIn | None = None
    features: Any = None
    session_id: str | None = None
    steering: Any = None


class ChatBody(Body):
    messages: list[MessageIn] = []
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    modalities: list[str] | None = None


class CompletionBody(Body):
    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


_NAMES = msgspec.json.Decoder(dict[str, msgspec.Raw])
_CHAT = msgspec.json.Decoder(ChatBody)
_COMPLETION = msgspec.json.Decoder(CompletionBody)


def _in(value: Any, name: str, lo: float, hi: float, default: Any) -> Any:
    if value is None:
        return default
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _policy(raw: bytes, known: frozenset[str], *, chat: bool) -> None:
    """The unimplemented/unknown-field policy needs the names a Struct drops: a lazy decode of them."""
    refused = CHAT_REFUSED if chat else COMPLETION_REFUSED
    names = _NAMES.decode(raw)
    check_fields({k: msgspec.json.decode(v) if k in refused else None for k, v in names.items()}, known, chat=chat)


def _common(b: Body, max_tokens: int | None, top: int | None, as_dict: dict[str, Any]) -> Common:
    n = _in(b.n, "n", 1, MAX_CHOICES, 1)
    temperature = float(_in(b.temperature, "temperature", 0.0, 2.0, 1.0))
    top_p = float(_in(b.top_p, "top_p", 0.0, 1.0, 1.0))
    seed = _in(b.seed, "seed", -INT64, INT64 - 1, None)
    min_tokens = _in(b.min_tokens, "min_tokens", 0, 2**62, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    if b.stop_token_ids is not None and any(t < 0 for t in b.stop_token_ids):
        raise bad_request("'stop_token_ids' must be an array of token ids (integers >= 0)", "stop_token_ids")
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    options = b.stream_options or StreamOptions()
    sampling = Sampling(
        ignore_eos=b.ignore_eos,
        min_tokens=min_tokens,
        stop_token_ids=tuple(b.stop_token_ids or ()),
        include_stop_str_in_output=b.include_stop_str_in_output,
        presence_penalty=float(_in(b.presence_penalty, "presence_penalty", -2.0, 2.0, 0.0)),
        frequency_penalty=float(_in(b.frequency_penalty, "frequency_penalty", -2.0, 2.0, 0.0)),
        repetition_penalty=float(_in(b.repetition_penalty, "repetition_penalty", 0.0, 2.0, 1.0)),
        logit_bias=_logit_bias(b.logit_bias),
        min_p=float(_in(b.min_p, "min_p", 0.0, 1.0, 0.0)),
    )
    readouts = msgspec.structs.asdict(b.readouts) if isinstance(b.readouts, ReadoutsIn) else b.readouts
    return Common(
        model=b.model,
        stream=b.stream,
        include_usage=b.stream and options.include_usage,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(0, _in(b.top_k, "top_k", -1, 2**62, 0)),
        seed=None if seed is None else seed % INT64,
        deterministic=b.deterministic,
        stop=_stop(b.stop),
        n=n,
        sampling=sampling,
        top_logprobs=top,
        logprobs_binary=_logprobs_encoding(as_dict, top),
        readouts=_readouts(readouts),
        features=parse_features(b.features),
        session_id=b.session_id,
        steering=b.steering,
        structured=read_structured(as_dict),
        structured_param="structured_outputs" if b.structured_outputs is not None else "response_format",
    )


def _parts(m: MessageIn) -> list[Part]:
    if m.content is None:
        return [TextPart("")]
    if isinstance(m.content, str):
        return [TextPart(m.content)]
    return [TextPart(p.text) for p in m.content if isinstance(p, TextIn)]  # images: not in these shapes


def msgspec_chat(raw: bytes) -> ChatRequest:
    BUDGET.check_json(raw, "the request body")
    _policy(raw, CHAT_FIELDS, chat=True)
    b = _CHAT.decode(raw)
    top = _in(b.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    fields = {
        "response_format": b.response_format,
        "structured_outputs": b.structured_outputs,
        "logprobs_encoding_format": b.logprobs_encoding_format,
        "logprobs_dtype": b.logprobs_dtype,
    }
    common = _common(b, _in(max_tokens, "max_tokens", 0, 2**62, None), (top or 0) if b.logprobs else None, fields)
    tools = None
    if b.tools:
        definitions = tuple(
            {
                "type": "function",
                "function": {
                    "name": t.function.name,
                    "description": t.function.description,
                    "parameters": t.function.parameters or {"type": "object", "properties": {}},
                },
            }
            for t in b.tools
        )
        tools = Tools(definitions, "auto", b.parallel_tool_calls)
    messages = tuple(Message(m.role if m.role != "developer" else "system", _parts(m)) for m in b.messages)
    return ChatRequest(common, messages, tools)


def msgspec_completion(raw: bytes) -> CompletionRequest:
    BUDGET.check_json(raw, "the request body")
    _policy(raw, COMPLETION_FIELDS, chat=False)
    b = _COMPLETION.decode(raw)
    top = _in(b.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS, None)
    fields = {
        "response_format": b.response_format,
        "structured_outputs": b.structured_outputs,
        "logprobs_encoding_format": b.logprobs_encoding_format,
        "logprobs_dtype": b.logprobs_dtype,
    }
    common = _common(b, _in(b.max_tokens, "max_tokens", 0, 2**62, None), top, fields)
    return CompletionRequest(common, _prompt(b.prompt), b.echo)


# -- the pydantic floor: the same shape as TypedDicts -----------------------------------------


class _Msg(TypedDict, total=False):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None
    tool_call_id: str | None


class _Func(TypedDict, total=False):
    name: str
    description: str | None
    parameters: dict[str, Any] | None


class _Tool(TypedDict):
    type: Literal["function"]
    function: _Func


class _Body(TypedDict, total=False):
    model: str
    stream: bool
    stream_options: dict[str, bool] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | list[str] | None
    presence_penalty: float | None
    repetition_penalty: float | None
    logit_bias: dict[str, float] | None
    min_p: float | None
    response_format: dict[str, Any] | None
    readouts: bool | dict[str, Any] | None
    steering: Any
    features: Any


class _Chat(_Body, total=False):
    messages: list[_Msg]
    logprobs: bool
    top_logprobs: int | None
    tools: list[_Tool] | None
    tool_choice: Any


class _Completion(_Body, total=False):
    prompt: str | list[int] | list[str]
    logprobs: int | None


def _pydantic() -> dict[bool, Callable[[bytes], Any]] | None:
    try:
        from pydantic import TypeAdapter
    except ImportError:
        return None
    chat, completion = TypeAdapter(_Chat), TypeAdapter(_Completion)
    return {True: chat.validate_json, False: completion.validate_json}


# -- the measurement ------------------------------------------------------------------------------


def variants() -> dict[str, Callable[[bool, bytes], Any]]:
    out: dict[str, Callable[[bool, bytes], Any]] = {
        "hand-written": lambda chat, raw: (parse_chat if chat else parse_completion)(
            json_input.loads(raw, BUDGET, "the request body")
        ),
        "msgspec": lambda chat, raw: (msgspec_chat if chat else msgspec_completion)(raw),
        "floor: budget.check_json": lambda chat, raw: BUDGET.check_json(raw, "the request body"),
        "floor: json.loads": lambda chat, raw: json.loads(raw),
        "floor: msgspec Struct decode only": lambda chat, raw: (_CHAT if chat else _COMPLETION).decode(raw),
    }
    adapters = _pydantic()
    if adapters is not None:
        out["pydantic floor: validate_json (TypedDict)"] = lambda chat, raw: adapters[chat](raw)
    return out


def per_call_us(work: Callable[[bool, bytes], Any], chat: bool, raw: bytes, calls: int) -> float:
    """CPU microseconds per call (thread CPU time, so other processes' load does not count)."""
    start = time.thread_time()
    for _ in range(calls):
        work(chat, raw)
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds, variants alternating (>= 9 for the medians)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant, shape and round")
    parser.add_argument("--quick", action="store_true", help="9 rounds of 300 calls (seconds)")
    parser.add_argument("--results", default="request_models", help="results name (bench/results/NAME.json)")
    args = parser.parse_args()
    calls = 300 if args.quick else args.calls
    work = variants()
    names = list(work)
    bodies = {shape: (chat, json.dumps(body).encode()) for shape, (chat, body) in SHAPES.items()}
    for shape, (chat, raw) in bodies.items():  # the prototype gives what the codec gives
        a = work["hand-written"](chat, raw)
        b = work["msgspec"](chat, raw)
        assert a == b, f"{shape}: the msgspec prototype disagrees with the codec"
        for name in names:
            per_call_us(work[name], chat, raw, 50)  # warm up
    times: dict[tuple[str, str], list[float]] = {(s, n): [] for s in bodies for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for shape, (chat, raw) in bodies.items():
            for name in order:
                times[shape, name].append(per_call_us(work[name], chat, raw, calls))
    rows = []
    for shape, (_, raw) in bodies.items():
        base = times[shape, "hand-written"]
        for name in names:
            ratios = [t / b for t, b in zip(times[shape, name], base, strict=True)]
            rows.append(
                {
                    "shape": shape,
                    "bytes": len(raw),
                    "variant": name,
                    "us per request": median(times[shape, name]),
                    "ratio to hand-written": median(ratios),
                    "spread": [min(ratios), max(ratios)],
                }
            )
    print(table(rows, ["shape", "bytes", "variant", "us per request", "ratio to hand-written", "spread"]))
    path = write_results(args.results, {"rounds": args.rounds, "calls": calls, "rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
