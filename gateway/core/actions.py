"""What a client asks of a session, in protocol-neutral terms.

Codecs build these from their wire messages; :mod:`prismgate.core.service` validates
them against the session and the engine's limits. Construction checks only what is
knowable without a session (types, signs, ranges that are backwards).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prismgate.core.errors import invalid
from prismgate.core.steering import Steering

if TYPE_CHECKING:
    from prismgate.core.features import FeatureSpec

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class PositionRange:
    """Absolute token positions ``[start, end)`` in a session's timeline."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < 0:
            raise invalid(f"position range [{self.start}, {self.end}) has a negative bound")
        if self.end < self.start:
            raise invalid(f"position range [{self.start}, {self.end}) ends before it starts")

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and self.start <= position < self.end


def covered(ranges: tuple[PositionRange, ...], position: int) -> bool:
    return any(position in r for r in ranges)


def first_covered(ranges: tuple[PositionRange, ...]) -> int | None:
    starts = [r.start for r in ranges if r.end > r.start]
    return min(starts) if starts else None


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """How to decode, and what to report at which positions.

    ``temperature == 0`` means greedy decoding. ``top_k == 0`` and ``top_p == 1`` turn
    those filters off. Logprobs are always computed from the model's raw distribution,
    before temperature and filters, so that they mean the same thing for every sampler.
    Greedy decoding picks the first entry of the top logprobs: the most likely token, the
    lowest id among equals.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprob_ranges: tuple[PositionRange, ...] = ()
    logprob_top_k: int = 0
    readout_ranges: tuple[PositionRange, ...] = ()
    priority: int = 0
    steering: Steering = ()  # vectors added to the residual stream (see prismgate.core.steering)
    # the same ids, logprobs and readouts whatever else runs (docs/determinism.md); None: the server's default
    deterministic: bool | None = None
    features: FeatureSpec | None = None  # SAE features to report (prismgate.core.features), at its own ranges

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise invalid(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise invalid(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise invalid(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise invalid(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.logprob_top_k <= MAX_TOP_LOGPROBS:
            raise invalid(f"logprob top-k must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprob_top_k}")
        if any(t < 0 for t in self.stop_token_ids):
            raise invalid("stop token ids must be >= 0")
        if any(s == "" for s in self.stop_strings):
            raise invalid("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise invalid(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def wants_readouts(self) -> bool:
        return any(r.end > r.start for r in self.readout_ranges)

    @property
    def wants_features(self) -> bool:
        return self.features is not None and self.features.wanted

    @property
    def wants_logprobs(self) -> bool:
        return any(r.end > r.start for r in self.logprob_ranges)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image a client places in the timeline at ``[start, end)`` (its whole vision block)."""

    data: bytes
    mime: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class GenerateAction:
    """Append to a session (optionally rewinding first), then generate.

    ``offset`` is the client's view of the session length. It must equal the real
    length, or be smaller with ``truncating`` set, in which case the session is rewound
    to ``offset`` before the append. ``offset=None`` means "append at the end,
    whatever the length": only for callers that own the session outright (one
    WebSocket, one HTTP request), never for clients that share it.
    """

    append_tokens: tuple[int, ...] = ()
    images: tuple[ImageInput, ...] = ()
    offset: int | None = None
    truncating: bool = False
    spec: GenerateSpec = field(default_factory=GenerateSpec)
    detokenize: bool = False  # fill TokenEvent.text / Done.text for decoded tokens
    atomic: bool = False  # a chat turn: all or nothing (see prismgate.core.turns)
    origin: str = ""  # the protocol that sent it ("salience", "graphpipe", ...), for metrics and logs
