"""What an engine streams back for one generation: token events, then one Done."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from prismgate.core.features import Features

Readout = npt.NDArray[np.float32]
"""A float32 array of shape ``[n_layers, n_concepts]`` for one token position."""


class FinishReason(enum.Enum):
    EOS = "eos"  # the model emitted EOS or one of the request's stop token ids
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the consumer went away or cancelled the action
    STOP_STRING = "stop_string"  # a stop string matched in the decoded text
    PREFILL_ONLY = "prefill_only"  # max_tokens was 0: nothing was decoded


@dataclass(slots=True)
class TokenEvent:
    """One token position of the session's timeline.

    Prefill events carry prompt tokens (only for positions a client asked to see);
    decode events carry sampled tokens (always). ``logprob`` is the log-probability of
    ``id`` given everything before it; ``top_logprobs`` holds the k most likely
    alternatives at that position, best first.
    """

    id: int
    position: int
    is_prefill: bool
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    readout: Readout | None = None
    features: Features | None = None  # SAE features, when the request asked for them here
    text: str | None = None  # text released by this token when the action asked for text


@dataclass(slots=True)
class Done:
    """The end of one generation, with counts a client can reconcile against."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason
    cached_tokens: int = 0  # prompt tokens served from the engine's cache (not recomputed)
    prefilled_tokens: int = 0  # prompt tokens the engine actually ran through the model
    stop_string: str | None = None
    text: str | None = None  # text held back until the end (see prismgate.core.text)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


Event = TokenEvent | Done
