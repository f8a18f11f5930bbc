"""The per-request budget: every count and size a request can carry, checked before the work.

A request is hostile input until it has passed these checks: a few bytes on the wire can ask
for a million position ranges or a prompt whose tokenizing alone takes seconds. The limits live
in one :class:`RequestBudget`, which :class:`~prismgate.core.service.SessionService` checks for
every protocol, and client JSON is scanned for its depth and values (:func:`json_depth`,
:func:`json_values`) before it is parsed. Which refusal each limit gives, why JSON is measured
before parsing, and the limits sized from the served models (:meth:`RequestBudget.sized`):
docs/architecture.md, "The request budget".
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from prismgate.core.actions import GenerateSpec
from prismgate.core.chat import TextPart
from prismgate.core.errors import exhausted, invalid
from prismgate.core.limits import ContextOverflow
from prismgate.core.prompts import Messages, PromptSource, Text
from prismgate.core.structured import Kind, Structured

UNSIZED_HIDDEN = 16384  # the budget's model facts before any model has loaded
UNSIZED_CONTEXT = 131072
JSON_ROOM = 65536  # values beyond token ids and directions: keys, messages, stop lists, ranges
STRUCT_BYTES_PER_NUMBER = 11  # a number in a google.protobuf.ListValue: tag, length, tag and a double
CONFIG_ROOM = 256 << 10


@dataclass(frozen=True, slots=True)
class RequestBudget:
    max_stop_strings: int = 64
    max_stop_token_ids: int = 1024
    max_stop_string_chars: int = 1024
    max_position_ranges: int = 256  # per kind: logprob ranges, readout ranges
    # a prompt's text is refused unread when it has more UTF-8 bytes than this many per
    # token of the model's context: no tokenizer packs that much into one token on average
    prompt_bytes_per_context_token: int = 64
    # a prompt tree (Evergreen) may share a node many times: leaves counted as expanded
    max_expanded_leaves: int = 100_000
    max_actions_in_flight: int = 1024  # per session (Evergreen: GENERATE and DROP not yet ended)
    max_json_depth: int = 64  # nesting of arrays and objects in any JSON a client sends
    max_steering_entries: int = 8  # each costs a vector add per steered token in every forward pass
    # a structured-output constraint (JSON schema, regex, grammar, choices): its bytes and nesting,
    # checked before an engine compiles it (compile time and memory grow with both)
    max_grammar_bytes: int = 32768
    max_grammar_depth: int = 16
    # facts of the served models, not settings (:meth:`sized`): the largest hidden size and
    # context among them; these defaults stand while no model has loaded
    hidden_size: int = field(default=UNSIZED_HIDDEN, metadata={"derived": True})
    context: int = field(default=UNSIZED_CONTEXT, metadata={"derived": True})

    def sized(self, hidden_size: int, context: int) -> RequestBudget:
        """This budget for models whose largest hidden size and context are these."""
        if (hidden_size, context) == (self.hidden_size, self.context):
            return self
        return replace(self, hidden_size=hidden_size, context=context)

    @property
    def max_json_values(self) -> int:
        """Values one JSON document may hold: what a request can need, and some room for its keys.

        Token ids of a whole context twice over (a prompt and a prompt tree's fragments), a
        prompt tree's leaves, every steering entry's direction, and :data:`JSON_ROOM`.
        """
        return 2 * (self.context + self.max_expanded_leaves) + self.max_steering_entries * self.hidden_size + JSON_ROOM

    @property
    def max_config_bytes(self) -> int:
        """Bytes of a generation config in protobuf (Evergreen's GenerateConfig or Struct), checked before decoding.

        Each steering direction at :data:`STRUCT_BYTES_PER_NUMBER` a number (its size in a
        Struct's ListValue; packed doubles take 8), and :data:`CONFIG_ROOM` for the rest
        (stop strings are at most 64 KiB at the default limits).
        """
        return self.max_steering_entries * self.hidden_size * STRUCT_BYTES_PER_NUMBER + CONFIG_ROOM

    def check_json(self, raw: bytes | str, what: str) -> None:
        """JSON holding too many values, or nested too deep, is refused before a parser reads it.

        The values first: their count copies nothing, and once it is bounded, what the depth
        scan copies (the text outside strings) is bounded too.
        """
        values = json_values(raw, self.max_json_values)
        if values > self.max_json_values:
            raise invalid(
                f"{what} holds more than {self.max_json_values} JSON values, more than any request to the models "
                f"served here needs (their context, a prompt tree's leaves and max_steering_entries directions "
                "of their hidden size)"
            )
        depth = json_depth(raw)
        if depth > self.max_json_depth:
            raise invalid(f"{what} nests JSON {depth} levels deep; the limit is {self.max_json_depth} (max_json_depth)")

    def check_config_bytes(self, size: int, what: str) -> None:
        if size > self.max_config_bytes:
            raise invalid(
                f"{what} is {size} bytes; a generation config for the models served here is at most "
                f"{self.max_config_bytes} (max_steering_entries directions of their hidden size, and room for the rest)"
            )

    def check_direction(self, numbers: int, where: str) -> None:
        """A steering direction longer than any served model's hidden size, refused before its numbers are read."""
        if numbers > self.hidden_size:
            raise invalid(
                f"{where} has {numbers} numbers; a direction is the model's hidden size "
                f"(at most {self.hidden_size} for the models served here)"
            )

    def check_leaves(self, count: int) -> None:
        """A prompt tree whose expansion (a shared node counted each time it is used) is too large."""
        if count > self.max_expanded_leaves:
            raise exhausted(
                f"the input tree expands to {count} leaves (shared nodes counted each time they are used); "
                f"the limit is {self.max_expanded_leaves}"
            )

    def check_spec(self, spec: GenerateSpec) -> None:
        """Lists in a spec that reach the engine, or the decode loop, once per token."""
        self.check_lists(
            stop_strings=spec.stop_strings,
            stop_token_ids=len(spec.stop_token_ids),
            logprob_ranges=len(spec.logprob_ranges),
            readout_ranges=len(spec.readout_ranges),
            steering_entries=len(spec.steering),
        )
        if spec.structured is not None:
            self.check_structured(spec.structured)

    def check_structured(self, structured: Structured) -> None:
        """A constraint too large, or a schema nested too deep, to compile: refused before any compiler reads it."""
        size = structured.size
        if size > self.max_grammar_bytes:
            raise invalid(
                f"the {structured.kind.value} constraint is {size} bytes; the limit is {self.max_grammar_bytes} "
                "(max_grammar_bytes)"
            )
        if structured.kind is Kind.JSON_SCHEMA:
            depth = json_depth(structured.source)
            if depth > self.max_grammar_depth:
                raise invalid(
                    f"the JSON schema nests {depth} levels deep; the limit is {self.max_grammar_depth} "
                    "(max_grammar_depth)"
                )

    def check_lists(
        self,
        *,
        stop_strings: Sequence[str] = (),
        stop_token_ids: int = 0,
        logprob_ranges: int = 0,
        readout_ranges: int = 0,
        steering_entries: int = 0,
    ) -> None:
        """The same limits on counts a codec knows before it builds a spec (no objects per element yet)."""
        if stop_token_ids > self.max_stop_token_ids:
            raise invalid(f"{stop_token_ids} stop token ids; the limit is {self.max_stop_token_ids}")
        if len(stop_strings) > self.max_stop_strings:
            raise invalid(f"{len(stop_strings)} stop strings; the limit is {self.max_stop_strings}")
        longest = max((len(s) for s in stop_strings), default=0)
        if longest > self.max_stop_string_chars:
            raise invalid(f"a stop string of {longest} characters; the limit is {self.max_stop_string_chars}")
        for name, count in (("logprob", logprob_ranges), ("readout", readout_ranges)):
            if count > self.max_position_ranges:
                raise invalid(f"{count} {name} ranges; the limit is {self.max_position_ranges}")
        if steering_entries > self.max_steering_entries:
            raise invalid(f"{steering_entries} steering entries; the limit is {self.max_steering_entries}")

    def check_prompt(self, prompt: PromptSource, context: int) -> None:
        """Refuse a prompt whose text cannot fit the context, from its size, before tokenizing it."""
        limit = self.prompt_bytes_per_context_token * context
        texts = _texts(prompt)
        chars = sum(len(t) for t in texts)
        # a character is 1 to 4 UTF-8 bytes: encode (bounded by the limit) only when that decides
        size = (
            chars
            if chars > limit or chars * 4 <= limit
            else sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        )
        if size > limit:
            raise ContextOverflow(
                f"the prompt holds over {limit} bytes of text, more than the model's context of {context} tokens "
                f"can take ({self.prompt_bytes_per_context_token} bytes per token)",
                context=context,
            )


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STRING_TEXT = re.compile(_STRING.pattern.decode(), re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_values(raw: bytes | str, limit: int) -> int:
    """An upper bound on the values in ``raw``, exact enough to compare with ``limit``, copying nothing.

    The values are the commas and the arrays and objects outside strings, plus one (an
    object's key and value count as one). Counting all of them, strings included, is a
    count at C speed and usually already under the limit; only past it are the strings'
    own commas and brackets taken back out, string by string (at most ``limit`` strings
    are looked at: a document with more holds more values than that anyway).
    """
    text: Any = raw  # bytes or str alike: the counts and the pattern take either
    marks: tuple[Any, ...] = (",", "[", "{") if isinstance(raw, str) else (b",", b"[", b"{")
    count = sum(text.count(m) for m in marks) + 1
    if count <= limit:
        return count
    strings: Any = _STRING_TEXT if isinstance(raw, str) else _STRING
    for seen, match in enumerate(strings.finditer(text)):
        if seen > limit:
            break
        start, end = match.span()
        count -= sum(text.count(m, start, end) for m in marks)
        if count <= limit:
            break
    return int(count)


def json_depth(raw: bytes | str) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (strings skipped), without parsing it.

    An unterminated string counts its brackets: that can only overstate the depth of text
    the parser would refuse anyway.
    """
    if isinstance(raw, str):
        if "[" not in raw and "{" not in raw:
            return 0
        data = _STRING_TEXT.sub("", raw).encode("utf-8", "surrogatepass")
    else:
        if b"[" not in raw and b"{" not in raw:
            return 0
        data = _STRING.sub(b"", raw)
    codes = np.frombuffer(data.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int64)
    return int(np.cumsum(steps).max(initial=0))


def too_many_digits(exc: ValueError) -> str | None:
    """Python's refusal of an over-long integer literal, said for a client; None for other errors."""
    if "integer string conversion" not in str(exc):
        return None
    return f"a number has more than {sys.get_int_max_str_digits()} digits"


def _texts(prompt: PromptSource) -> list[str]:
    if isinstance(prompt, Text):
        return [prompt.text]
    if isinstance(prompt, Messages):
        return [part.text for m in prompt.messages for part in m.parts if isinstance(part, TextPart)]
    return []
