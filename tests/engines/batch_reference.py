"""The batched decode step as it was before the merged cache was kept across steps: the reference.

Every step merged every member's whole cache into a new batch cache (left-padded with zeros to
the longest) and copied each member's part back. :mod:`prismgate.engines.hf.batch_cache` must
give the same bits (tests/engines/test_batch_cache.py); bench/batch_decode.py times the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prismgate.engines.hf.adapters import ModelAdapter, check_cache


def per_step_merge(
    adapter: ModelAdapter, ids: Sequence[int], caches: Sequence[Any], positions: Sequence[int]
) -> torch.Tensor:
    for cache, position in zip(caches, positions, strict=True):
        check_cache(cache, position)
    width = max(positions)
    batch = adapter.new_cache()
    for index in range(len(caches[0].layers)):
        keys, values = [], []
        for cache, position in zip(caches, positions, strict=True):
            layer = cache.layers[index]
            pad = width - position
            keys.append(torch.nn.functional.pad(layer.keys, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(layer.values, (0, 0, pad, 0)))
        batch.update(torch.cat(keys), torch.cat(values), index)
    logits = adapter.forward_batch(ids, batch, positions, width)
    for index, merged in enumerate(batch.layers):
        for row, (cache, position) in enumerate(zip(caches, positions, strict=True)):
            layer = cache.layers[index]
            layer.keys = merged.keys[row : row + 1, :, width - position :].contiguous()
            layer.values = merged.values[row : row + 1, :, width - position :].contiguous()
    return logits
