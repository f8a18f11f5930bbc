"""``tools`` and ``tool_choice`` in, Hermes-style ``<tool_call>`` blocks out as OpenAI ``tool_calls``.

The model's chat template renders the tools (a template that declares tool use; the core
refuses the others). Templates of the Hermes family (Qwen2.5, SmolLM3, Hermes) have the model
answer a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; those blocks
become ``message.tool_calls`` (streamed as ``tool_calls`` deltas, one per finished block) and
the text around them the content. ``tool_choice``: ``auto`` lets the model choose, ``none``
leaves the tools out of the prompt, ``required`` and a named function hold the answer to calls
with a grammar (:class:`~prismgate.core.structured.Structured`), as vLLM does.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prismgate.codecs.openai.errors import bad_request
from prismgate.core.chat import ToolCall
from prismgate.core.structured import Kind, Structured

MAX_TOOLS = 128
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True, slots=True)
class Tools:
    """The request's functions (as the template reads them) and what ``tool_choice`` asks."""

    definitions: tuple[dict[str, Any], ...]
    choice: str  # "auto", "required" or a function's name ("none" never gets here)
    parallel: bool = True  # parallel_tool_calls: more than one call in an answer

    @property
    def constraint(self) -> Structured | None:
        """``required``: one call, or more with ``parallel_tool_calls``; a named function: one call of it."""
        if self.choice == "auto":
            return None
        wanted = [d for d in self.definitions if self.choice == "required" or d["function"]["name"] == self.choice]
        calls = [_call_schema(d["function"]) for d in wanted]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema["x-guidance"] = {"whitespace_flexible": False}
        body = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        more = ' ("\\n" call)*' if self.parallel and self.choice == "required" else ""
        grammar = f'start: call{more}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {body}\n'
        return Structured(Kind.GRAMMAR, grammar)


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def read_tools(body: Mapping[str, Any]) -> Tools | None:
    """``tools`` and ``tool_choice``, checked; None when no tool may be called."""
    value = body.get("tools")
    choice = body.get("tool_choice")
    if not value:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array of function tools", "tools")
    if len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' holds {len(value)} tools; at most {MAX_TOOLS} are allowed", "tools")
    definitions = tuple(_tool(item, f"tools[{i}]") for i, item in enumerate(value))
    names = [d["function"]["name"] for d in definitions]
    if len(set(names)) != len(names):
        raise bad_request("'tools' names a function twice", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    parallel = parallel is not False
    if choice is None or choice == "auto":
        return Tools(definitions, "auto", parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(definitions, "required", parallel)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in names:
        raise bad_request(f"'tool_choice' names the function {name[:64]!r}, which is not in 'tools'", "tool_choice")
    return Tools(definitions, name, parallel)


def _tool(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
        raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{'name': ...}}}}", where)
    function = item["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-'", where)
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"'{where}.function.parameters' must be a JSON schema object", where)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{where}.function.description' must be a string", where)
    out: dict[str, Any] = {"name": name}
    if description is not None:
        out["description"] = description
    out["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": out}


def read_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``: each ``{id, type: "function", function: {name, arguments}}``."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"'{where}' must be an array of at most {MAX_TOOLS} tool calls", where)
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call.get("id"), str):
            raise bad_request(f"'{at}' must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", at)
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise bad_request(f"'{at}.function' needs a 'name' and 'arguments' (JSON text)", at)
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_request(f"'{at}.function.arguments' must be the JSON text of an object", at)
        calls.append(ToolCall(call["id"], name, arguments))
    return tuple(calls)


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``text`` without its ``<tool_call>`` blocks, and the calls they hold (a block that is no call stays text)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    cursor = 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[cursor : match.start()])
        cursor = match.end()
        calls.append(call)
    kept.append(text[cursor:])
    return "".join(kept).strip() if calls else text, calls


def _call(block: str) -> ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall("call_" + secrets.token_hex(12), value["name"], json.dumps(arguments, ensure_ascii=False))


def as_wire(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(id=call.id, type="function", function={"name": call.name, "arguments": call.arguments})
    return out


@dataclass(slots=True)
class CallStream:
    """Splits streamed text into content to show now and calls as their blocks close.

    Text from an opening ``<tool_call>`` on is held until its block closes (then a call, or
    text again when it holds none); so is a tail that could be the start of one.
    """

    held: str = ""
    calls: int = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.held += text
        shown: list[str] = []
        found: list[ToolCall] = []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = _partial_open(self.held)
                shown.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            shown.append(self.held[:start])
            end = self.held.find(CLOSE, start)
            if end < 0:
                self.held = self.held[start:]
                break
            block = self.held[start : end + len(CLOSE)]
            call = _call(block[len(OPEN) : -len(CLOSE)])
            if call is None:
                shown.append(block)
            else:
                found.append(call)
            self.held = self.held[end + len(CLOSE) :]
        self.calls += len(found)
        content = "".join(shown)
        if found and not content.strip():
            content = ""
        return content, found

    def flush(self) -> str:
        """What is still held when the answer ends: text (an unclosed block is no call)."""
        out, self.held = self.held, ""
        return out


def _partial_open(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
