"""Pieces -> OpenAI JSON: chat completions and (legacy) text completions.

Each format knows its ``object`` names, where text goes (``message.content`` /
``delta.content`` vs ``text``), and its logprobs shape:

* chat: ``logprobs.content[] = {token, logprob, bytes, top_logprobs[]}``;
* completions: parallel arrays ``tokens``, ``token_logprobs``, ``top_logprobs``
  (one ``{token: logprob}`` map per token) and ``text_offset`` (character offset of
  each token in the returned text).

prismgate extensions live under one key, ``"prismgate"``, and appear only when a
request asked for them (readouts, a session): per choice the readouts of the tokens
that choice (or chunk) carries, at the top level what those numbers mean (layers and
concepts) and the session's id and length.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from prismgate.codecs.binary_numbers import BASE64, INT32, b64, dtype_name
from prismgate.codecs.openai.errors import OpenAIError
from prismgate.codecs.openai.features import describe as describe_features
from prismgate.codecs.openai.features import features_of
from prismgate.codecs.openai.generation import Piece, Token
from prismgate.codecs.openai.plan import Plan
from prismgate.codecs.openai.readouts import ReadoutAxes
from prismgate.codecs.openai.tools import CallStream, as_wire, parse_calls
from prismgate.core.chat import ToolCall
from prismgate.core.events import Done, FinishReason

# one encoder for every payload: json.dumps with options builds a new one per call
dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode

_FINISH = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_STRING: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.PREFILL_ONLY: "length",
}


def finish_reason(done: Done) -> str:
    reason = _FINISH.get(done.finish_reason)
    if reason is None:  # CANCELLED with the client still there: the server is stopping
        raise OpenAIError(
            503, "the generation was cancelled: the server is shutting down", type="server_error", code="cancelled"
        )
    return reason


def merged(dones: Sequence[Done]) -> Done:
    """The ``Done`` the usage of several choices of one prompt reports: the prompt once, every choice's tokens."""
    first = dones[0]
    return Done(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(d.completion_tokens for d in dones),
        finish_reason=first.finish_reason,
        cached_tokens=first.cached_tokens,
    )


def combine(responses: Sequence[dict[str, Any]], dones: Sequence[Done]) -> dict[str, Any]:
    """One response of several choices, from each choice's own response (every choice in order)."""
    out = dict(responses[0])
    out["choices"] = [r["choices"][0] for r in responses]
    out["usage"] = usage(merged(dones))
    return out


def usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.total_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _readouts(axes: ReadoutAxes, tokens: Sequence[Token]) -> list[dict[str, Any]]:
    return [
        {"position": t.position, "id": t.id, "token": t.text, "values": axes.values(t.readout)}
        for t in tokens
        if t.readout is not None
    ]


def _readouts_json(axes: ReadoutAxes, tokens: Sequence[Token]) -> str | None:
    """``dumps(_readouts(axes, tokens))``, or None when a value has no JSON form (the general path refuses it)."""
    items = []
    for t in tokens:
        if t.readout is None:
            continue
        values = axes.values_json(t.readout)
        if values is None:
            return None
        items.append(f'{{"position":{t.position:d},"id":{t.id:d},"token":{dumps(t.text)},"values":{values}}}')
    return "[" + ",".join(items) + "]"


def _logprobs_base64(tokens: Sequence[Token], k: int, dtype: np.dtype) -> dict[str, str]:
    """The tokens' logprobs as base64 (``prismgate.logprobs``): ids and logprobs, and ``[token][k]`` alternatives.

    Ids are little-endian int32; a missing logprob (an echoed prompt's first token) is NaN,
    a missing alternative id -1 with a NaN logprob.
    """
    ids = np.array([t.id for t in tokens], dtype=INT32)
    logprobs = np.array([math.nan if t.logprob is None else t.logprob for t in tokens], dtype=np.float64)
    out = {"ids": b64(ids, INT32), "logprobs": b64(logprobs, dtype)}
    if k:
        top_ids = np.full((len(tokens), k), -1, dtype=INT32)
        top = np.full((len(tokens), k), math.nan)
        for i, t in enumerate(tokens):
            for j, (tid, entry) in enumerate(zip(t.top_ids or (), t.top or (), strict=False)):
                if j < k:
                    top_ids[i, j], top[i, j] = tid, entry[2]
        out.update(top_ids=b64(top_ids, INT32), top_logprobs=b64(top, dtype))
    return out


class Format:
    """What chat and completions share: ids, timestamps, the prismgate block, usage chunks."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, plan: Plan, include_usage: bool, *, index: int = 0, first: Format | None = None) -> None:
        """The format of choice ``index``; choices after the first share the ``first`` one's id and time."""
        self.plan = plan
        self.include_usage = include_usage
        self.index = index
        self.id: str = first.id if first is not None else self.id_prefix + secrets.token_hex(12)
        self.created: int = first.created if first is not None else int(time.time())
        self.text_offset = 0
        # what every token's chunk repeats, as JSON text: the envelope up to the choice's own
        # fields, and what closes it (see :meth:`piece_payloads`)
        self._open = (
            f'{{"id":{dumps(self.id)},"object":{dumps(self.chunk_object_name)},"created":{self.created:d},'
            f'"model":{dumps(self.plan.model)},"choices":[{{"index":{index:d},'
        )
        self._close = ',"usage":null}' if include_usage else "}"

    # -- shared pieces -----------------------------------------------------------------

    def extension(self, session_length: int | None = None) -> dict[str, Any] | None:
        ext: dict[str, Any] = {}
        if self.plan.axes is not None:
            ext["readouts"] = self.plan.axes.describe()
        if self.plan.logprobs_binary is not None:
            ext["logprobs"] = {
                "encoding_format": BASE64,
                "dtype": dtype_name(self.plan.logprobs_binary),
                "top_logprobs": self.plan.top_logprobs,
            }
        if self.plan.features is not None:
            ext["features"] = describe_features(self.plan.features)
        if self.plan.session_id is not None:
            ext["session_id"] = self.plan.session_id
            if session_length is not None:
                ext["session_length"] = session_length
        return ext or None

    def envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.plan.model,
            "choices": choices,
        }
        out.update({k: v for k, v in extra.items() if v is not None})
        return out

    def choice_extension(self, choice: dict[str, Any], tokens: Sequence[Token]) -> dict[str, Any]:
        ext: dict[str, Any] = {}
        if self.plan.axes is not None:
            ext["readouts"] = _readouts(self.plan.axes, tokens)
        if self.plan.logprobs_binary is not None:
            ext["logprobs"] = _logprobs_base64(tokens, self.plan.top_logprobs, self.plan.logprobs_binary)
        if self.plan.features is not None:
            ext["features"] = features_of(tokens, self.plan.feature_manifest)
        if ext:
            choice["prismgate"] = ext
        return choice

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        out = self.envelope(self.chunk_object_name, choices, **extra)
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last carries a null usage
        return out

    def usage_chunk(self, done: Done, session_length: int | None) -> dict[str, Any]:
        out = self.envelope(self.chunk_object_name, [], prismgate=self.extension(session_length))
        out["usage"] = usage(done)
        return out

    # -- per format ----------------------------------------------------------------------

    def head(self) -> list[dict[str, Any]]:
        return []

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        raise NotImplementedError

    def piece_payloads(self, piece: Piece) -> list[str]:
        """``piece``'s chunks as JSON text: a stream writes this for every token.

        Without logprobs the chunk is the same text as ``dumps(chunk)`` assembled from the
        parts every chunk repeats; anything else goes the general way.
        """
        if not self.plan.want_logprobs and self.plan.features is None:
            readouts = None if self.plan.axes is None else _readouts_json(self.plan.axes, piece.tokens)
            if self.plan.axes is None or readouts is not None:
                fields = self._choice_fields(piece)
                if readouts is not None:
                    fields += ',"prismgate":{"readouts":' + readouts + "}"
                return [self._open + fields + "}]" + self._extra() + self._close]
        return [dumps(chunk) for chunk in self.piece(piece)]

    def _choice_fields(self, piece: Piece) -> str:
        """A piece's choice without logprobs, after its index, as JSON text."""
        raise NotImplementedError

    def _extra(self) -> str:
        """Top-level members of a piece's chunk between ``choices`` and ``usage``."""
        return ""

    def tail(self, done: Done, session_length: int | None) -> list[dict[str, Any]]:
        """The choice's last chunk, then (with ``include_usage``) the usage chunk."""
        out = [self.finish(done, session_length)]
        if self.include_usage:
            out.append(self.usage_chunk(done, session_length))
        return out

    def finish(self, done: Done, session_length: int | None) -> dict[str, Any]:
        """The chunk that carries the choice's ``finish_reason``."""
        raise NotImplementedError

    def response(self, pieces: Sequence[Piece], done: Done, session_length: int | None) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def _logprobs(self, tokens: Sequence[Token]) -> dict[str, Any] | None:
        if not self.plan.want_logprobs or self.plan.logprobs_binary is not None:
            return None
        content = [
            {
                "token": t.text,
                "logprob": t.logprob,
                "bytes": t.bytes,
                "top_logprobs": [{"token": s, "logprob": lp, "bytes": b} for s, b, lp in (t.top or [])],
            }
            for t in tokens
        ]
        return {"content": content, "refusal": None}

    def head(self) -> list[dict[str, Any]]:
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self.chunk([choice], prismgate=self.extension())]

    def __init__(self, plan: Plan, include_usage: bool, *, index: int = 0, first: Format | None = None) -> None:
        super().__init__(plan, include_usage, index=index, first=first)
        self.calls = CallStream() if plan.tool_calls else None  # <tool_call> blocks -> tool_calls deltas

    def piece_payloads(self, piece: Piece) -> list[str]:
        if self.calls is not None:
            return [dumps(chunk) for chunk in self.piece(piece)]
        return super().piece_payloads(piece)

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        delta: dict[str, Any] = {"content": piece.text}
        if self.calls is not None:
            before = self.calls.calls
            text, found = self.calls.feed(piece.text)
            delta = {"content": text} if text else {}
            if found:
                delta["tool_calls"] = [as_wire(c, before + i) for i, c in enumerate(found)]
            reports = self.plan.want_logprobs or self.plan.axes is not None or self.plan.features is not None
            if not delta and not (reports and piece.tokens):
                return []  # held: it may open a tool call
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": self._logprobs(piece.tokens),
            "finish_reason": None,
        }
        return [self.chunk([self.choice_extension(choice, piece.tokens)])]

    def _choice_fields(self, piece: Piece) -> str:
        return f'"delta":{{"content":{dumps(piece.text)}}},"logprobs":null,"finish_reason":null'

    def _finish_reason(self, done: Done, called: bool) -> str:
        reason = finish_reason(done)
        return "tool_calls" if called and reason == "stop" else reason

    def finish(self, done: Done, session_length: int | None) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        called = False
        if self.calls is not None:
            held = self.calls.flush()  # an unclosed block: text after all
            if held:
                delta["content"] = held
            called = self.calls.calls > 0
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": self._finish_reason(done, called),
        }
        return self.chunk([choice], prismgate=self.extension(session_length))

    def response(self, pieces: Sequence[Piece], done: Done, session_length: int | None) -> dict[str, Any]:
        tokens = [t for p in pieces for t in p.tokens]
        content: str | None = "".join(p.text for p in pieces)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        calls: list[ToolCall] = []
        if self.calls is not None and content is not None:
            content, calls = parse_calls(content)
            message["content"] = content or None
            if calls:
                message["tool_calls"] = [as_wire(c) for c in calls]
        choice = {
            "index": self.index,
            "message": message,
            "logprobs": self._logprobs(tokens),
            "finish_reason": self._finish_reason(done, bool(calls)),
        }
        return self.envelope(
            self.object_name,
            [self.choice_extension(choice, tokens)],
            usage=usage(done),
            prismgate=self.extension(session_length),
        )


class CompletionFormat(Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"
    _described = False

    def _logprobs(self, pieces: Sequence[Piece]) -> dict[str, Any] | None:
        """Completions logprobs; advances ``text_offset`` over the pieces' text."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for piece in pieces:
            start, end = self.text_offset, self.text_offset + len(piece.text)
            at = start
            for t in piece.tokens:
                offsets.append(min(at, end))
                at += len(t.text)
                tokens.append(t.text)
                token_logprobs.append(t.logprob)
                if t.logprob is None:
                    top_logprobs.append(None)
                elif t.top:
                    best: dict[str, float] = {}
                    for s, _, lp in t.top:  # best first; tokens whose text collides keep the likelier
                        best.setdefault(s, lp)
                    top_logprobs.append(best)
                else:
                    top_logprobs.append({t.text: t.logprob})
            self.text_offset = end
        if not self.plan.want_logprobs or self.plan.logprobs_binary is not None:
            return None
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        choice = {"index": self.index, "text": piece.text, "logprobs": self._logprobs([piece]), "finish_reason": None}
        return [self.chunk([self.choice_extension(choice, piece.tokens)], prismgate=self._first_extension())]

    def _choice_fields(self, piece: Piece) -> str:
        self.text_offset += len(piece.text)  # as _logprobs keeps it
        return f'"text":{dumps(piece.text)},"logprobs":null,"finish_reason":null'

    def _extra(self) -> str:
        ext = self._first_extension()
        return "" if ext is None else ',"prismgate":' + dumps(ext)

    def _first_extension(self) -> dict[str, Any] | None:
        """The readout axes and session ride on the first chunk (completions have no role chunk)."""
        if self._described:
            return None
        self._described = True
        return self.extension()

    def finish(self, done: Done, session_length: int | None) -> dict[str, Any]:
        choice = {"index": self.index, "text": "", "logprobs": None, "finish_reason": finish_reason(done)}
        return self.chunk([choice], prismgate=self.extension(session_length))

    def response(self, pieces: Sequence[Piece], done: Done, session_length: int | None) -> dict[str, Any]:
        tokens = [t for p in pieces for t in p.tokens]
        choice = {
            "index": self.index,
            "text": "".join(p.text for p in pieces),
            "logprobs": self._logprobs(pieces),
            "finish_reason": finish_reason(done),
        }
        return self.envelope(
            self.object_name,
            [self.choice_extension(choice, tokens)],
            usage=usage(done),
            prismgate=self.extension(session_length),
        )
