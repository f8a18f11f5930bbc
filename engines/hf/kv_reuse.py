"""KV reuse between turns: each session's cache is kept, and a new turn runs only what changed.

A session's KV cache (and the token ids it holds) is kept after its turn, least recently used
out first past ``max_tokens`` tokens or ``max_bytes`` bytes of storage. The next turn keeps the
longest prefix its tokens share with the cache, computed under the same steering, with the gate
readouts its gates read, and by the batch-invariant kernels if the turn is deterministic; it
runs the rest, and recomputes the cached positions it wants logprobs or readouts of (the cache
holds keys and values, not logits). docs/engines.md, "KV reuse", says why each rule is there.
The caches are touched by the worker thread only; other threads ask the scheduler to release.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from prismgate.core.actions import Fork, GenerateSpec, first_covered
from prismgate.core.session import ImageSpan
from prismgate.core.steering import SteeredSpan, agreed_prefix, spans
from prismgate.engines.hf.adapters import ModelAdapter
from prismgate.engines.hf.steering import GateKey

MAX_BYTES_FRACTION = 20  # the default byte bound: this fraction of the machine's memory ...
MAX_BYTES_MIN = 128 << 20  # ... at least this ...
MAX_BYTES_MAX = 2 << 30  # ... at most this


def default_max_bytes() -> int:
    """The byte bound when the setting is 0: a twentieth of the machine's memory, within bounds."""
    from prismgate.core.memory import machine_share

    return machine_share(MAX_BYTES_FRACTION, MAX_BYTES_MIN, MAX_BYTES_MAX)


def cache_bytes(cache: Any) -> int:
    """Bytes of storage ``cache``'s keys and values hold (a cropped cache still holds its whole storage)."""
    seen: set[int] = set()
    total = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if tensor is None or not hasattr(tensor, "untyped_storage"):
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


class Kept(NamedTuple):
    cache: Any  # None: nothing kept
    tokens: list[int]  # the token ids whose keys and values the cache holds
    steered: tuple[SteeredSpan, ...]  # the steering they were computed under, tiling [0, len(tokens))
    gates: dict[GateKey, list[float]]  # gate readouts of those positions (a prefix of them), by gate
    invariant: bool = True  # computed by the batch-invariant kernels throughout (a deterministic turn needs it)
    logits: Any = None  # a forked prefill: the float32 logits row that follows ``tokens`` (sessions keep none)


class SessionCaches:
    """KV caches by session key, bounded by the tokens and the bytes they hold (LRU)."""

    def __init__(self, max_tokens: int, max_bytes: int = 0) -> None:
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes if max_bytes > 0 else default_max_bytes()
        self._caches: OrderedDict[str, Kept] = OrderedDict()
        self._bytes: dict[str, int] = {}

    @property
    def bytes(self) -> int:
        """Bytes the kept caches hold."""
        return sum(self._bytes.values())

    def __len__(self) -> int:
        return len(self._caches)

    def take(self, key: str | None) -> Kept:
        """The session's cache, its token ids and their steering, now owned by the caller."""
        if key is None or key not in self._caches:
            return Kept(None, [], (), {})
        self._bytes.pop(key, None)
        return self._caches.pop(key)

    def keep(
        self,
        key: str,
        cache: Any,
        tokens: list[int],
        steered: tuple[SteeredSpan, ...],
        gates: dict[GateKey, list[float]] | None = None,
        invariant: bool = True,
    ) -> None:
        self._caches[key] = Kept(cache, tokens, steered, gates or {}, invariant)
        self._caches.move_to_end(key)
        self._bytes[key] = cache_bytes(cache)
        total = sum(len(kept.tokens) for kept in self._caches.values())
        held = self.bytes
        while (total > self.max_tokens or held > self.max_bytes) and len(self._caches) > 1:
            dropped_key, dropped = self._caches.popitem(last=False)
            total -= len(dropped.tokens)
            held -= self._bytes.pop(dropped_key, 0)

    def forget(self, key: str) -> None:
        self._caches.pop(key, None)
        self._bytes.pop(key, None)

    def peek(self, key: str) -> Kept:
        """The cache kept under ``key``, left in place (the caller must not change it)."""
        return self._caches.get(key, Kept(None, [], (), {}))


MAX_FORKS = 64  # prompts whose prefill waits for their other generations at once


class Forks:
    """Prefilled prompts kept for the other generations of the same prompt (:class:`Fork`).

    Kept among the session caches, under the same token and byte bounds (the least recently
    used goes first); each follower gets a copy, the last one the kept cache itself.
    """

    def __init__(self, caches: SessionCaches) -> None:
        self.caches = caches
        self._left: OrderedDict[str, int] = OrderedDict()  # followers still to come, by key
        self._logits: dict[str, Any] = {}  # the logits row after each kept prompt, by key

    def keep(self, fork: Fork, kept: Kept) -> None:
        """The leader's prompt, prefilled (with ``kept.logits``, the row its first token is sampled from):
        a copy waits for its followers, who then sample from that same row."""
        key = "fork:" + fork.key
        if fork.followers <= 0 or key in self._left:
            return
        self._left[key] = fork.followers
        self._logits[key] = None if kept.logits is None else kept.logits.clone()
        gates = {k: list(v) for k, v in kept.gates.items()}
        self.caches.keep(key, copy.deepcopy(kept.cache), list(kept.tokens), kept.steered, gates, kept.invariant)
        while len(self._left) > MAX_FORKS:
            oldest, _ = self._left.popitem(last=False)
            self._logits.pop(oldest, None)
            self.caches.forget(oldest)

    def take(self, fork: Fork) -> Kept:
        """A follower's copy of the prefilled prompt (nothing when none is kept)."""
        key = "fork:" + fork.key
        left = self._left.get(key, 0)
        if left <= 1:
            self._left.pop(key, None)
            logits = self._logits.pop(key, None)
            kept = self.caches.take(key)
            return kept if kept.cache is None else kept._replace(logits=logits)
        self._left[key] = left - 1
        kept = self.caches.peek(key)
        if kept.cache is None:
            return kept
        gates = {k: list(v) for k, v in kept.gates.items()}
        logits = self._logits.get(key)
        return kept._replace(
            cache=copy.deepcopy(kept.cache),
            tokens=list(kept.tokens),
            gates=gates,
            logits=None if logits is None else logits.clone(),
        )


def resume(
    adapter: ModelAdapter,
    kept: Kept,
    tokens: Sequence[int],
    images: Sequence[ImageSpan],
    spec: GenerateSpec,
    gates: Collection[GateKey] = (),
) -> tuple[Any, int]:
    """(the cache to run this turn on, the position to start running from).

    ``gates`` are the gate readouts the turn's steering reads: a position is served from the
    cache only when the readouts of the one before it are kept.

    The cache comes back holding exactly ``tokens[:start]``: cropped when the turn keeps
    less than was cached, new when nothing can be kept.
    """
    cache, cached = kept.cache, kept.tokens
    if spec.deterministic and not kept.invariant:
        cache, cached = None, []  # keys computed by other kernels would give other bits: run it all again
    n = len(tokens)
    start = 0
    for a, b in zip(cached, tokens, strict=False):
        if a != b:
            break
        start += 1
    start = min(start, agreed_prefix(kept.steered, spans(spec.steering, n, n)))
    for key in gates:
        start = min(start, len(kept.gates.get(key, ())))
    if spec.max_tokens > 0 and not (kept.logits is not None and len(cached) == n):
        start = min(start, n - 1)  # the last prompt token's logits are needed to sample (unless they are kept)
    first_lp = first_covered(spec.logprob_ranges)
    if first_lp is not None and first_lp < n:
        start = min(start, max(first_lp - 1, 0))
    first_ro = first_covered(spec.readout_ranges)
    if first_ro is not None and first_ro < n:
        start = min(start, first_ro)
    first_fe = first_covered(spec.features.ranges) if spec.features is not None else None
    if first_fe is not None and first_fe < n:  # features, like readouts, come from hidden states: recomputed
        start = min(start, first_fe)
    start = adapter.rewind_point(tokens, images, start, cache)
    if cache is None or start == 0:
        cache = adapter.new_cache()
    elif start < len(cached):
        cache.crop(start - len(cached))  # a negative count: tokens to drop from the end
    return cache, start
