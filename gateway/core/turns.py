"""A chat-shaped turn: the request a codec hands the core, and what the core planned for it.

Evergreen, OpenAI and GraphPipe do not place tokens at positions (Salience does, through
:class:`~prismgate.core.actions.GenerateAction` directly); they send a prompt, sampling knobs,
an optional ``max_tokens`` and which reports they want. :class:`ChatTurn` says exactly that,
and :meth:`SessionService.plan_turn` applies the core's rules to it (model, prompt placement,
``max_tokens`` and context fit, which positions are reported). This module also says the one
rule for what a turn leaves in its session (docs/architecture.md, "Turn atomicity").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prismgate.core.actions import GenerateAction, GenerateSpec
from prismgate.core.prompts import Append, Placement, PromptSource


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One turn of a chat-shaped protocol, in the protocol's own terms.

    ``sampling`` carries temperature, top-p/k, seed, stop ids and strings, priority;
    its ``max_tokens`` and ranges are ignored: the core sets them. ``max_tokens=None``
    means the protocol's ``default_max_tokens`` capped by the room left in the context,
    and ``default_max_tokens=None`` means all the room left (see :mod:`.limits`).
    """

    prompt: PromptSource
    origin: str
    sampling: GenerateSpec = field(default_factory=GenerateSpec)
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    logprobs: bool = False  # report logprobs (top-k from ``sampling.logprob_top_k``)
    readouts: bool = False
    report_prompt: bool = False  # reports also cover the appended prompt (OpenAI's echo)
    placement: Placement = Placement.REPLACE
    detokenize: bool = True


@dataclass(frozen=True, slots=True)
class Turn:
    """A planned turn: the action to run and what the client may want to know about it."""

    model: str
    session_id: str | None  # None: an ephemeral timeline, thrown away afterwards
    append: Append
    action: GenerateAction

    @property
    def prompt_tokens(self) -> int:
        return self.append.prompt_tokens

    @property
    def reused_tokens(self) -> int:
        return self.append.reused
