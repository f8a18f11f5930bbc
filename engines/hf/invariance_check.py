"""The start-up check that the batch-invariant kernels keep their promise on this device.

:mod:`~prismgate.engines.hf.invariant` relies on facts about the matrix-product kernels that
were measured on CPUs (a row's bits do not depend on the other rows once a product has enough
rows: :mod:`prismgate.engines.invariant_rows`). Another device or library build may break them,
so before the engine serves a single deterministic request it runs one sequence three ways and
compares every bit of the logits and of the keys and values: prefilled in one chunk, prefilled in
chunks of three and decoded token by token, and decoded inside batches of other sequences of
other lengths. Any difference and the
engine refuses deterministic requests, saying so, rather than promising what it cannot keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prismgate.engines.hf.adapters import ModelAdapter
from prismgate.engines.invariant_rows import SWITCH

_PROBE = "The quick brown fox jumps over the lazy dog, and the dog sleeps on."
_NEIGHBOURS = ("Une phrase", "def f(x):\n    return x * 2\n", "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13")


def _run(adapter: ModelAdapter, ids: Sequence[int], prefill: int, chunk: int) -> tuple[list[torch.Tensor], Any]:
    """Prefill ``ids[:prefill]`` in chunks of ``chunk``, then feed the rest one token at a time."""
    cache = adapter.new_cache()
    logits: list[torch.Tensor] = []
    position = 0
    while position < len(ids):
        end = min(prefill, position + chunk) if position < prefill else position + 1
        out = adapter.forward(ids[position:end], cache, position, ids, [], [end - 1 - position])
        logits.append(out[-1].float())  # the batched step's logits are float32
        position = end
    return logits, cache


def _batched(
    adapter: ModelAdapter, ids: Sequence[int], prefill: int, neighbours: list[list[int]]
) -> list[torch.Tensor]:
    """``ids`` decoded from ``prefill`` on inside a batch with ``neighbours`` (each decoding its own tokens)."""
    seqs = [list(ids[:prefill]), *neighbours]
    caches = []
    for seq in seqs:
        cache = adapter.new_cache()
        adapter.forward(seq[:-1], cache, 0, seq, [], [len(seq) - 2])
        caches.append(cache)
    logits = []
    for step in range(len(ids) - prefill + 1):
        fed = [ids[prefill - 1 + step]] + [seq[-1] for seq in seqs[1:]]
        out = adapter.decode_batch(fed, caches, [c.get_seq_length() for c in caches])
        logits.append(out[0])
        for seq, row in zip(seqs[1:], out[1:], strict=True):
            seq.append(int(torch.argmax(row)))
    return logits


def check(adapter: ModelAdapter) -> str | None:
    """None when every way of running the probe gives the same bits; else what differed."""
    ids = list(adapter.tokenizer(_PROBE)["input_ids"])
    neighbours = [list(adapter.tokenizer(text)["input_ids"]) for text in _NEIGHBOURS]
    prefill = len(ids) - 4
    with torch.inference_mode(), SWITCH.on():
        whole, cache_whole = _run(adapter, ids, prefill, len(ids))
        chunked, cache_chunked = _run(adapter, ids, prefill, 3)
        stepped, _ = _run(adapter, ids, len(ids), len(ids))
        batched = _batched(adapter, ids, prefill, neighbours)
    if not all(torch.equal(a, b) for a, b in zip(whole[-5:], chunked[-5:], strict=True)):
        return "logits of a prompt prefilled in one chunk and in chunks of 3 differ"
    for a, b in zip(cache_whole.layers, cache_chunked.layers, strict=True):
        if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
            return "keys and values prefilled in one chunk and in chunks of 3 differ"
    if not torch.equal(whole[-1], stepped[-1]):
        return "the logits after decoding tokens one by one and after prefilling them differ"
    if not all(torch.equal(a, b) for a, b in zip(whole[-5:], batched[:5], strict=True)):
        return "logits of a sequence decoded alone and inside a batch differ"
    return None
