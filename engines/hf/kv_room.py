"""Keys and values held in buffers with room to grow, so that a step appends in place.

transformers' ``DynamicCache`` appends a step's keys and values by concatenation: every prompt
chunk and every decoded token copies each layer's whole cache. Deep in a long context, or over
a batch's merged cache, that copy is a cost of every step that grows with the context
(docs/benchmarks.md, "Waiting behind a long prompt"). Here a layer's keys and values are the
first positions of a buffer whose length is a multiple of :data:`ROOM` positions; a step writes
its positions into the room, and only a step that overflows it moves the cache to a larger
buffer (one copy). A cache told the prompt it will hold (:func:`expect`) gets a buffer for all of
it at its first chunk.

The layers' keys and values stay ordinary tensors (views), read as before: the same bits
(tests/engines/test_kv_room.py). Code that replaces them (the batch's merged cache hands a member
its row back) gives the layer a tensor without room, and its next step moves it into a buffer of
its own. The memory budget counts the room: :data:`ROOM` is the transformers engine's
``EngineInfo.kv_block_tokens``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

ROOM = 256  # buffers hold a multiple of this many positions


class RoomLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place while its buffer has room."""

    expected = 0  # positions the layer is told it will hold (:func:`expect`)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = _append(self.keys, key_states, self.expected)
        self.values = _append(self.values, value_states, self.expected)
        return self.keys, self.values


def new_cache(config: Any) -> Any:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`RoomLayer`\\ s
    (sliding-window layers, which drop positions, stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [RoomLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def expect(cache: Any, positions: int) -> None:
    """Tell ``cache`` it will hold ``positions`` positions: its next move takes a buffer for all of them."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, RoomLayer):
            layer.expected = positions


def capacity(held: torch.Tensor) -> int:
    """Positions the buffer under ``held`` has for it: the buffer's when ``held`` is the first positions of
    a whole ``[batch, heads, capacity, dim]`` buffer; otherwise its own length (no room)."""
    if held.dim() != 4:
        return 0
    batch, heads, length, dim = held.shape
    if held.storage_offset() != 0 or held.stride(3) != 1 or held.stride(2) != dim or held.stride(1) % max(dim, 1):
        return length
    room = held.stride(1) // max(dim, 1)
    if room < length or (batch > 1 and held.stride(0) != heads * room * dim):
        return length
    if held.untyped_storage().nbytes() != batch * heads * room * dim * held.element_size():
        return length  # a view into something larger (a row of a merged batch): never written past its end
    return room


def _append(held: torch.Tensor | None, new: torch.Tensor, expected: int) -> torch.Tensor:
    """``held`` followed by ``new`` along positions: in place when ``held``'s buffer has room, else in a
    new buffer of a multiple of :data:`ROOM` positions (at least ``expected``)."""
    batch, heads, count, dim = new.shape
    length = held.shape[2] if held is not None and held.dim() == 4 else 0
    end = length + count
    fits = (
        held is not None
        and held.dim() == 4
        and held.shape[:2] == new.shape[:2]
        and held.shape[3] == dim
        and held.dtype == new.dtype
        and held.device == new.device
    )
    if held is not None and fits and capacity(held) >= end:
        out = held.as_strided((batch, heads, end, dim), held.stride())
    else:
        size = -(-max(end, expected) // ROOM) * ROOM
        out = new.new_empty((batch, heads, size, dim))[:, :, :end]
        if held is not None and length:
            out[:, :, :length].copy_(held)
    out[:, :, length:].copy_(new)
    return out
