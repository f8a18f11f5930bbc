"""The merged KV cache of requests that decode together, kept from one batched step to the next.

A batched decode step runs the members' caches as one ``[batch, heads, width, dim]`` cache, each
left-padded to the longest. Merging anew and copying back every step would copy all their keys
and values twice per token, so the merge outlives the step: a step appends one column, and the
members' caches are rebuilt only when one joins or leaves (:meth:`BatchCache.step`) or steps on
its own (:meth:`BatchCache.leave`). The merge is laid out exactly as a fresh one, so every row's
logits are the same bits (tests/engines/test_batch_cache.py). While a request is in the merge its
own cache is empty: a step that ran it alone would fail loudly rather than use stale keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prismgate.engines.hf.adapters import ModelAdapter, check_cache, padding_mask


class BatchCache:
    """The caches of the requests decoding together, merged into one and kept across steps."""

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.merged: Any = None  # the merged cache (None: nobody is in it)
        self.rows: list[Any] = []  # the members' own caches, by row; None where a member has left
        self.lengths: list[int] = []  # tokens each row holds (its columns end at `width`)
        self.width = 0
        self.regroups = 0  # merges built from the members' own caches (membership changes)

    def holds(self, cache: Any) -> bool:
        return cache is not None and any(row is cache for row in self.rows)

    def step(self, ids: Sequence[int], caches: Sequence[Any], positions: Sequence[int]) -> torch.Tensor:
        """Feed ``ids[j]`` at ``positions[j]`` to the request whose cache is ``caches[j]``.

        Returns float32 logits ``[batch, vocab]``. The requests stay in the merged cache;
        :meth:`leave` hands one its keys and values back.
        """
        self.prepare(caches, positions)
        logits = self.adapter.forward_batch(ids, self.merged, positions, self.width)
        self.advance()
        return logits

    def prepare(self, caches: Sequence[Any], positions: Sequence[int]) -> None:
        """Hold ``caches`` (rows in that order, at ``positions``) merged, ready for a step: merged anew
        when the members changed, else checked against the merge."""
        if len(self.rows) != len(caches) or any(a is not b for a, b in zip(self.rows, caches, strict=False)):
            self._regroup(caches, positions)
        else:
            for length, position in zip(self.lengths, positions, strict=True):
                if length != position:
                    raise RuntimeError(f"the batch's KV cache holds {length} tokens of a request at {position}")

    def mask(self) -> torch.Tensor:
        """The 2-D attention mask of the next step over the merge (:func:`padding_mask`)."""
        return padding_mask(self.lengths, self.width, self.adapter.device)

    def advance(self) -> None:
        """A step ran on the merge: every row holds one more token."""
        self.width += 1
        self.lengths = [length + 1 for length in self.lengths]

    def leave(self, cache: Any) -> None:
        """Give ``cache`` its keys and values back (a copy of its row, without the padding); no-op if not here."""
        if cache is None:
            return
        for row, held in enumerate(self.rows):
            if held is cache:
                start = self.width - self.lengths[row]
                for layer, merged in zip(cache.layers, self.merged.layers, strict=True):
                    layer.keys = merged.keys[row : row + 1, :, start:].contiguous()
                    layer.values = merged.values[row : row + 1, :, start:].contiguous()
                self._vacate(row)
                return

    def drop(self, cache: Any) -> None:
        """Forget ``cache``'s row without giving it back (its request failed: its cache is discarded)."""
        if cache is None:
            return
        for row, held in enumerate(self.rows):
            if held is cache:
                self._vacate(row)
                return

    def leave_all(self) -> None:
        for cache in list(self.rows):
            if cache is not None:
                self.leave(cache)

    def _vacate(self, row: int) -> None:
        self.rows[row] = None
        if all(held is None for held in self.rows):
            self.merged, self.rows, self.lengths, self.width = None, [], [], 0

    def _regroup(self, caches: Sequence[Any], positions: Sequence[int]) -> None:
        """Merge ``caches`` (rows in that order), each left-padded with zeros to the longest.

        A cache already merged takes its row of the old merge (its padding included, trimmed
        or widened to the new width); the others come from their own caches, which are then
        emptied. Members of the old merge not in ``caches`` get their keys and values back first.
        """
        for held in list(self.rows):
            if held is not None and not any(held is cache for cache in caches):
                self.leave(held)
        old_row = {id(held): row for row, held in enumerate(self.rows) if held is not None}
        for cache, position in zip(caches, positions, strict=True):
            row = old_row.get(id(cache))
            if row is None:
                check_cache(cache, position)
            elif self.lengths[row] != position:
                raise RuntimeError(f"the batch's KV cache holds {self.lengths[row]} tokens of a request at {position}")
        width = max(positions)
        merged = self.adapter.new_cache()
        for index in range(len(caches[0].layers)):
            keys, values = [], []
            for cache, position in zip(caches, positions, strict=True):
                row = old_row.get(id(cache))
                if row is None:
                    layer, pad = cache.layers[index], width - position
                    keys.append(torch.nn.functional.pad(layer.keys, (0, 0, pad, 0)))
                    values.append(torch.nn.functional.pad(layer.values, (0, 0, pad, 0)))
                else:  # columns [self.width - position, self.width) hold it: move them to end at `width`
                    layer = self.merged.layers[index]
                    keys.append(_rewidth(layer.keys[row : row + 1], self.width, width))
                    values.append(_rewidth(layer.values[row : row + 1], self.width, width))
            merged.update(torch.cat(keys), torch.cat(values), index)
        for cache in caches:
            if id(cache) not in old_row:
                for layer in cache.layers:  # its keys and values live in the merge now
                    layer.keys = layer.keys.new_empty((*layer.keys.shape[:2], 0, layer.keys.shape[3]))
                    layer.values = layer.values.new_empty((*layer.values.shape[:2], 0, layer.values.shape[3]))
        self.merged, self.rows, self.lengths, self.width = merged, list(caches), list(positions), width
        self.regroups += 1


def _rewidth(row: torch.Tensor, width: int, new: int) -> torch.Tensor:
    """A merged row whose columns end at ``width``, made to end at ``new`` (left padding cut or added)."""
    if new <= width:
        return row[:, :, width - new :]
    return torch.nn.functional.pad(row, (0, 0, new - width, 0))


class BatchCaches:
    """The merged caches of a round's batches: when more requests decode than one batch takes, the
    rest form further batches, each kept merged across steps in a :class:`BatchCache` of its own."""

    def __init__(self, adapter: ModelAdapter) -> None:
        self.adapter = adapter
        self.batches: list[BatchCache] = []

    def holding(self, caches: Sequence[Any]) -> BatchCache:
        """The merge for a batch of ``caches``: the one that holds most of them already, else an empty
        one; any other merge holding one of them gives it back first."""
        chosen = max(self.batches, key=lambda batch: sum(batch.holds(cache) for cache in caches), default=None)
        if chosen is None or not any(chosen.holds(cache) for cache in caches):
            chosen = next((batch for batch in self.batches if batch.merged is None), None)
            if chosen is None:
                chosen = BatchCache(self.adapter)
                self.batches.append(chosen)
        for batch in self.batches:
            if batch is not chosen:
                for cache in caches:
                    batch.leave(cache)
        return chosen

    def advance(self, merged: Any) -> None:
        """A step ran on ``merged`` (a mixed pass carried its rows): its merge holds one more token a row."""
        if merged is None:
            return
        for batch in self.batches:
            if batch.merged is merged:
                batch.advance()

    def leave(self, cache: Any) -> None:
        """Give ``cache`` its keys and values back, from whichever merge holds it (no-op if none does)."""
        for batch in self.batches:
            batch.leave(cache)

    def drop(self, cache: Any) -> None:
        """Forget ``cache``'s row wherever it is merged, without giving it back."""
        for batch in self.batches:
            batch.drop(cache)
