"""What a client asks of a session, in protocol-neutral terms.

Codecs build these from their wire messages; :mod:`prismgate.core.service` validates
them against the session and the engine's limits. Construction checks only what is
knowable without a session (types, signs, ranges that are backwards).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from prismgate.core.errors import invalid
from prismgate.core.features import FeatureSpec
from prismgate.core.positions import PositionRange as PositionRange
from prismgate.core.steering import Steering
from prismgate.core.structured import Structured

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias, either way


def covered(ranges: tuple[PositionRange, ...], position: int) -> bool:
    return any(position in r for r in ranges)


def first_covered(ranges: tuple[PositionRange, ...]) -> int | None:
    starts = [r.start for r in ranges if r.end > r.start]
    return min(starts) if starts else None


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """How to decode, and what to report at which positions.

    ``temperature == 0`` means greedy decoding. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0``
    turn those filters off. Logprobs are always computed from the model's raw distribution,
    before penalties, biases, temperature and filters, so that they mean the same thing for
    every sampler. Without penalties, ``logit_bias`` or ``min_tokens``, greedy decoding picks
    the first entry of the top logprobs: the most likely token, the lowest id among equals.

    Penalties, ``logit_bias``, ``min_p`` and ``min_tokens`` mean what they mean in vLLM's
    ``SamplingParams``: ``min_tokens`` masks the stop ids (and EOS, unless ``ignore_eos``) until
    that many tokens are out, and no stop string matches before then; ``presence_penalty`` and
    ``frequency_penalty`` count generated tokens, ``repetition_penalty`` every token seen
    (prompt and generated).

    ``structured`` masks every token the grammar does not allow next, after the penalties and
    before temperature and the filters, as vLLM applies its grammar bitmask; the turn ends
    (finish reason EOS) once the grammar is complete. Logprobs stay those of the raw logits.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop id, EOS or stop string ends the turn before this many tokens
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated so far
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of every token seen
    min_p: float = 0.0  # drops tokens less likely than min_p times the likeliest (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    include_stop_str_in_output: bool = False  # the matched stop string stays at the end of the text
    stop_token_text: bool = True  # the text of the stop id that ended the turn is part of the text
    logprob_ranges: tuple[PositionRange, ...] = ()
    logprob_top_k: int = 0
    readout_ranges: tuple[PositionRange, ...] = ()
    priority: int = 0
    steering: Steering = ()  # vectors added to the residual stream (see prismgate.core.steering)
    # the same ids, logprobs and readouts whatever else runs (docs/determinism.md); None: the server's default
    deterministic: bool | None = None
    features: FeatureSpec | None = None  # SAE features to report (prismgate.core.features), at its own ranges
    # the grammar the generated text must follow (prismgate.core.structured); None: free text
    structured: Structured | None = None

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
        if self.min_tokens < 0:
            raise invalid(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise invalid(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise invalid(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise invalid(f"min_p must be in [0, 1], got {self.min_p}")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise invalid(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {token}: {bias}")

    def ends_on(self, token: int, generated: int, eos_token_ids: Collection[int]) -> bool:
        """Whether ``token``, the ``generated``-th decoded token (counting from 1), ends the turn."""
        if generated <= self.min_tokens:
            return False
        return token in self.stop_token_ids or (not self.ignore_eos and token in eos_token_ids)

    def stop_ids(self, eos_token_ids: Collection[int]) -> frozenset[int]:
        """The ids that end the turn once ``min_tokens`` are out: the stop ids, and EOS unless ignored."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    @property
    def shapes_logits(self) -> bool:
        """Whether anything besides temperature and the top-k/top-p/min-p filters changes the logits."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

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
class Fork:
    """Generations of one prompt (a request's choices): the engine may prefill it once.

    The leader (``followers > 0``) keeps a copy of its prefilled cache for that many requests of
    the same ``key``, which start from it instead of prefilling the prompt again; a follower
    (``followers == 0``) that finds no copy prefills it itself. An optimisation only: every
    request's tokens, logprobs and readouts are what they would be without it.
    """

    key: str
    followers: int = 0


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
    fork: Fork | None = None  # one of several generations of this prompt (ignored in a session)
