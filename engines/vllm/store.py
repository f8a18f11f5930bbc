"""What the vLLM engine remembers per session: readouts, SAE features and logprobs it already computed.

vLLM's prefix cache keeps keys and values, not hidden states or logits: a position it
serves from the cache is never run through the model again, so no readout is computed for it. The
engine therefore keeps, per session, every readout the worker sent for that session's
timeline and every logprob it reported, so that a later turn asking about an earlier
position is answered from here instead of turning the prefix cache off.

Entries are validated against the request's tokens: a value at position ``p`` depends on
tokens ``0..p`` only, so it stays valid for as long as the new timeline shares that prefix
(a rewound or forked session keeps what still applies), and as long as the new request
steers that prefix as the turns that computed it did (:func:`prismgate.core.steering.agreed_prefix`).
The store is an LRU capped by the number of positions it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from prismgate.core.steering import SteeredSpan, agreed_prefix
from prismgate.engines.vllm.features import FeatureRow

if TYPE_CHECKING:
    from prismgate.engines.vllm.tracker import Tracker

LogprobEntry = tuple[int, float, list[tuple[int, float]]]  # top-k it was computed with, logprob, top list


@dataclass
class SessionValues:
    tokens: list[int] = field(default_factory=list)
    readouts: dict[int, npt.NDArray[np.float32]] = field(default_factory=dict)
    logprobs: dict[int, LogprobEntry] = field(default_factory=dict)
    computed: int = 0  # positions [0, computed) were run through the model for this session (cache may hold them)
    steered: tuple[SteeredSpan, ...] = ()  # the steering each run of ``tokens`` was computed under
    features: dict[int, FeatureRow] = field(default_factory=dict)  # SAE features, when a turn asked for them

    @property
    def size(self) -> int:
        return len(self.readouts) + len(self.logprobs) + len(self.features)

    def valid_for(self, tokens: Sequence[int], steered: Sequence[SteeredSpan]) -> SessionValues:
        """The entries that still hold for ``tokens`` steered as ``steered`` says (the shared prefix)."""
        shared = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            shared += 1
        shared = min(shared, agreed_prefix(self.steered, steered))
        return SessionValues(
            tokens=list(tokens[:shared]),
            readouts={p: v for p, v in self.readouts.items() if p < shared},
            logprobs={p: v for p, v in self.logprobs.items() if p < shared},
            computed=min(self.computed, shared),
            steered=tuple(steered),
            features={p: v for p, v in self.features.items() if p < shared},
        )

    def logprob(self, position: int, top_k: int) -> LogprobEntry | None:
        entry = self.logprobs.get(position)
        if entry is None or entry[0] < top_k:
            return None
        return (top_k, entry[1], entry[2][:top_k])

    def learnt(
        self,
        prompt: Sequence[int],
        generated: Sequence[int],
        tracker: Tracker,
        decoded: Mapping[int, LogprobEntry],
        steered: tuple[SteeredSpan, ...],
    ) -> SessionValues:
        """These values plus what one turn computed: the worker's rows and the decoded tokens' logprobs.

        ``steered`` is the steering of the turn's timeline, prompt and generated tokens.
        """
        timeline = [*prompt, *generated]
        limit = len(timeline)
        readouts = dict(self.readouts)
        logprobs = dict(self.logprobs)
        readouts.update((p, v) for p, v in tracker.readouts.items() if p < limit)
        for p, row in tracker.logprobs.items():
            if p < limit:
                logprobs[p] = (len(row[2]), row[1], list(zip(row[2], row[3], strict=True)))
        logprobs.update(decoded)
        features = dict(self.features)
        features.update((p, v) for p, v in tracker.features.items() if p < limit)
        computed = max([self.computed, *(p + 1 for p in tracker.computed if p < limit)], default=0)
        if generated:  # vLLM computed at least every prompt position and all but the last token
            computed = max(computed, limit - 1)
        return SessionValues(timeline, readouts, logprobs, computed, steered, features)


class ValueStore:
    """Per-session values, least recently used first out, capped in positions held."""

    def __init__(self, max_positions: int = 1 << 18) -> None:
        self.max_positions = max_positions
        self._sessions: OrderedDict[str, SessionValues] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def lookup(self, key: str | None, tokens: Sequence[int], steered: Sequence[SteeredSpan]) -> SessionValues:
        if key is None or key not in self._sessions:
            return SessionValues()
        self._sessions.move_to_end(key)
        return self._sessions[key].valid_for(tokens, steered)

    def put(self, key: str, values: SessionValues) -> None:
        self.release(key)
        if values.size > self.max_positions:
            return
        self._sessions[key] = values
        self._held += values.size
        while self._held > self.max_positions and len(self._sessions) > 1:
            _, dropped = self._sessions.popitem(last=False)
            self._held -= dropped.size

    def release(self, key: str) -> None:
        old = self._sessions.pop(key, None)
        if old is not None:
            self._held -= old.size
