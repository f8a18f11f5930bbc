"""Prompt planning for chat-shaped protocols: what to append to a session, and where.

A chat-shaped client (Evergreen, OpenAI, GraphPipe) sends a prompt, not tokens placed
at positions: messages to render, text to encode, or token ids. The core turns it into
an append onto the session's timeline in one of two ways (:class:`Placement`):

* ``REPLACE``: the prompt is the whole conversation (Evergreen re-sends its tree each
  turn). Only the part past the longest prefix the session shares with it is appended;
  the rest of the session is rewound, so a follow-up turn prefills just its delta;
* ``CONTINUE``: the prompt is what comes next (OpenAI's ``session_id`` turns send only
  their new messages); it is rendered as a continuation of the earlier turns.

Rendering and tokenizing cost time in proportion to the prompt, so
:meth:`SessionService.plan_turn` runs :func:`plan_prompt` in a worker thread.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prismgate.core.actions import ImageInput
from prismgate.core.chat import Message, ModelCatalog, Prompt, TextPart, render
from prismgate.core.errors import invalid
from prismgate.core.session import ImageSpan


@dataclass(frozen=True, slots=True)
class Messages:
    """Chat messages, rendered with the model's chat template (or plainly, one after another)."""

    messages: Sequence[Message]
    chat_template: bool = True
    tools: Sequence[dict[str, Any]] = ()  # function definitions for a template that declares tool use


@dataclass(frozen=True, slots=True)
class Text:
    """Plain text, encoded as it is (no chat template)."""

    text: str


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token ids as the client sent them (checked against the vocabulary by the core)."""

    ids: tuple[int, ...]


PromptSource = Messages | Text | Tokens


class Placement(enum.Enum):
    REPLACE = "replace"  # the prompt is the whole timeline
    CONTINUE = "continue"  # the prompt follows the timeline


def build_prompt(models: ModelCatalog, model: str, source: PromptSource) -> Prompt:
    """The prompt's tokens from position 0 (blocking: tokenizes)."""
    if isinstance(source, Messages):
        return render(models, source.messages, model=model, chat_template=source.chat_template, tools=source.tools)
    if isinstance(source, Text):
        return Prompt(tuple(models.info(model).tokenizer.encode(source.text, special=models.specials_in_text)))
    return Prompt(source.ids)


def plan_prompt(
    models: ModelCatalog,
    model: str,
    timeline: Sequence[int],
    images: Sequence[ImageSpan],
    source: PromptSource,
    placement: Placement,
) -> Append:
    """The append that makes the session's timeline hold ``source`` (blocking: tokenizes)."""
    if placement is Placement.REPLACE or not timeline:
        return plan_append(timeline, images, build_prompt(models, model, source))
    if isinstance(source, Messages) and source.chat_template:
        prompt = render_continuation(models, timeline, source.messages, model=model)
        return Append(len(timeline), False, prompt.tokens, prompt.images)
    tokens = build_prompt(models, model, source).tokens
    return Append(len(timeline), False, tokens, ())


@dataclass(frozen=True, slots=True)
class Append:
    """What to send to the core so that a session's timeline becomes a prompt."""

    offset: int
    truncating: bool
    tokens: tuple[int, ...]
    images: tuple[ImageInput, ...]

    @property
    def reused(self) -> int:
        """Tokens of the session this prompt keeps (the engine need not prefill them again)."""
        return self.offset

    @property
    def prompt_tokens(self) -> int:
        """Where decoding starts: the kept prefix plus the append."""
        return self.offset + len(self.tokens)


def plan_append(session_tokens: Sequence[int], session_images: Sequence[ImageSpan], prompt: Prompt) -> Append:
    """Keep the longest prefix the session shares with ``prompt``; append the rest.

    The cut never lands inside an image block, and an image block only counts as shared
    when the same image (by digest) sits at the same place in both.
    """
    keep = 0
    limit = min(len(session_tokens), len(prompt.tokens))
    while keep < limit and session_tokens[keep] == prompt.tokens[keep]:
        keep += 1
    wanted = {(im.start, im.end): ImageSpan.of(im.start, im.end, im.data, im.mime).digest for im in prompt.images}
    for span in sorted(session_images, key=lambda s: s.start):
        if span.start >= keep:
            break
        if span.end > keep or wanted.get((span.start, span.end)) != span.digest:
            keep = span.start
            break
    for im in prompt.images:  # never keep half of a new image block either
        if im.start < keep < im.end:
            keep = im.start
    return Append(
        offset=keep,
        truncating=keep < len(session_tokens),
        tokens=tuple(prompt.tokens[keep:]),
        images=tuple(im for im in prompt.images if im.start >= keep),
    )


# -- continuing a session by new messages only (OpenAI's session_id) ------------------------------

_PROBE_USER = Message("user", [TextPart("probe")])
_PROBE_REPLIES = ("probe reply 1", "probe reply 2")


def render_continuation(
    models: ModelCatalog,
    timeline: Sequence[int],
    messages: Sequence[Message],
    *,
    model: str | None = None,
    add_generation_prompt: bool = True,
) -> Prompt:
    """The tokens to append to ``timeline`` (earlier turns) so that it continues with ``messages``.

    For clients that send only a conversation's new messages. Derived from the chat
    template itself, not from knowledge of any one format: a probe conversation
    ``[user, assistant]`` is rendered with and without the new messages after it, and
    the difference is how the new messages look after a finished assistant turn
    (without, say, the default system prompt some templates add only at the start).
    The closing tokens of an assistant turn (ChatML's ``<|im_end|>\\n``) come from two
    probes that differ only in the reply's text; whatever part of them the timeline
    does not already end with (a reply that stopped on EOS holds ``<|im_end|>`` but not
    the newline, one cut off by ``max_tokens`` neither) goes first. Image positions in
    the returned prompt are absolute (they start at ``len(timeline)`` or later). An
    empty timeline is a new conversation: the whole rendering.
    """
    if not timeline:
        return render(models, messages, model=model, add_generation_prompt=add_generation_prompt)
    if not messages:
        raise invalid("a chat turn needs at least one new message")
    probe = [_PROBE_USER, Message("assistant", [TextPart(_PROBE_REPLIES[0])])]
    before = render(models, probe, model=model, add_generation_prompt=False).tokens
    after = render(models, [*probe, *messages], model=model, add_generation_prompt=add_generation_prompt)
    if after.tokens[: len(before)] != before:
        raise invalid(
            f"the chat template of {models.info(model).model_id!r} does not render new messages as an append to "
            "earlier turns; send the whole conversation without a session"
        )
    closer = assistant_closer(models, model=model)
    missing = closer[_already_closed(timeline, closer) :]
    shift = len(timeline) + len(missing) - len(before)
    images = tuple(
        ImageInput(data=im.data, mime=im.mime, start=im.start + shift, end=im.end + shift) for im in after.images
    )
    return Prompt(tuple(missing) + after.tokens[len(before) :], images)


def assistant_closer(models: ModelCatalog, *, model: str | None = None) -> tuple[int, ...]:
    """The tokens the chat template puts after an assistant message's text (e.g. ``<|im_end|>\\n``)."""
    a, b = (
        render(
            models, [_PROBE_USER, Message("assistant", [TextPart(reply)])], model=model, add_generation_prompt=False
        ).tokens
        for reply in _PROBE_REPLIES
    )
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


def _already_closed(timeline: Sequence[int], closer: Sequence[int]) -> int:
    """How many leading tokens of ``closer`` the timeline already ends with."""
    for k in range(min(len(closer), len(timeline)), 0, -1):
        if list(timeline[-k:]) == list(closer[:k]):
            return k
    return 0
