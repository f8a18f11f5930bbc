"""Keys and values appended in place (engines/hf/kv_room.py): concatenation's bits, fewer copies, no aliasing."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from prismgate.engines.hf import kv_room


def _states(positions: int, batch: int = 1, value: float = 0.0) -> torch.Tensor:
    return torch.arange(batch * 2 * positions * 4, dtype=torch.float32).view(batch, 2, positions, 4) + value


def test_a_layer_appends_in_place_while_its_buffer_has_room_and_moves_once_when_it_overflows() -> None:
    layer = kv_room.RoomLayer()
    keys, _ = layer.update(_states(100), _states(100))
    buffer = keys.data_ptr()
    assert kv_room.capacity(keys) == kv_room.ROOM
    for step in range(kv_room.ROOM - 100):
        keys, _ = layer.update(_states(1, value=step), _states(1))
        assert keys.data_ptr() == buffer  # in place
    assert keys.shape[2] == kv_room.ROOM
    keys, values = layer.update(_states(3, value=7.0), _states(3))
    assert keys.data_ptr() != buffer and kv_room.capacity(keys) == 2 * kv_room.ROOM  # moved, with room again
    steps = [_states(1, value=s) for s in range(kv_room.ROOM - 100)]
    want = torch.cat([_states(100), *steps, _states(3, value=7.0)], 2)
    assert torch.equal(keys, want) and values.shape == want.shape


def test_a_cache_told_its_prompt_takes_one_buffer_for_all_of_it() -> None:
    layer = kv_room.RoomLayer()
    cache = DynamicCache()
    cache.layers = [layer]
    kv_room.expect(cache, 1000)
    keys, _ = layer.update(_states(64), _states(64))
    buffer = keys.data_ptr()
    assert kv_room.capacity(keys) == 1024
    for _ in range(14):
        keys, _ = layer.update(_states(64), _states(64))
    assert keys.shape[2] == 960 and keys.data_ptr() == buffer


def test_cropped_positions_are_written_over_and_replaced_keys_move_to_a_buffer_of_their_own() -> None:
    layer = kv_room.RoomLayer()
    layer.update(_states(10), _states(10))
    layer.crop(-4)
    keys, _ = layer.update(_states(2, value=0.5), _states(2))
    assert torch.equal(keys, torch.cat([_states(10)[:, :, :6], _states(2, value=0.5)], 2))
    layer.keys = _states(5).contiguous()  # as the batch's merged cache hands a member its row back
    given = layer.keys
    keys, _ = layer.update(_states(1), _states(1))
    assert keys.data_ptr() != given.data_ptr() and torch.equal(keys[:, :, :5], given)


def test_a_view_into_something_larger_is_never_written_past_its_end() -> None:
    merged = torch.zeros(2, 2, kv_room.ROOM, 4)
    row = merged[0:1, :, :10]  # the first row of a merged batch: from the buffer's start, with columns after it
    assert kv_room.capacity(row) == 10
    layer = kv_room.RoomLayer()
    layer.lazy_initialization(row, row)
    layer.keys, layer.values = row, row
    layer.update(_states(3, value=9.0), _states(3, value=9.0))
    assert torch.count_nonzero(merged) == 0
    copied = copy.deepcopy(layer)  # a fork's copy keeps its room, in storage of its own
    assert kv_room.capacity(copied.keys) == kv_room.capacity(layer.keys) == kv_room.ROOM
    copied.update(_states(1, value=5.0), _states(1))
    assert layer.keys.shape[2] == 13 and copied.keys.shape[2] == 14
    assert torch.equal(layer.keys, copied.keys[:, :, :13])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engines_logits_are_the_bits_concatenation_gives(tiny_model_dir, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """Prompts in chunks, a step alone, then steps of a merged batch: every logit equal with
    transformers' own cache and with this one."""
    from prismgate.engines.hf.batch_cache import BatchCache
    from prismgate.engines.hf.loading import load

    adapter = load(
        tiny_model_dir, model_id="m", concept_pack=None, device="cpu", dtype=dtype, max_model_len=None
    ).adapter
    prompts = [[5 + (i * 7 + row) % 40 for i in range(300 + 37 * row)] for row in range(3)]

    def run(new_cache: object) -> list[torch.Tensor]:
        adapter.new_cache = new_cache  # type: ignore[method-assign]
        out, caches = [], []
        for prompt in prompts:
            cache = adapter.new_cache()
            kv_room.expect(cache, len(prompt))  # nothing on transformers' own cache
            for start in range(0, len(prompt), 96):
                end = min(start + 96, len(prompt))
                out.append(adapter.forward(prompt[start:end], cache, start, [], [], [end - start - 1]))
            out.append(adapter.forward([9], cache, len(prompt), [], [], [0]))  # a step alone
            caches.append(cache)
        batch = BatchCache(adapter)
        positions = [len(p) + 1 for p in prompts]
        for step in range(kv_room.ROOM):  # through the merge's first move
            out.append(batch.step([11 + step % 30] * 3, caches, positions))
            positions = [p + 1 for p in positions]
        batch.leave(caches[1])
        out.append(batch.step([3, 3], [caches[0], caches[2]], [positions[0], positions[2]]))
        out.append(adapter.forward([4], caches[1], positions[1], [], [], [0]))
        return out

    def plain() -> DynamicCache:
        return DynamicCache(config=adapter.model.config)

    with torch.inference_mode():
        ours = run(lambda: kv_room.new_cache(adapter.model.config))
        theirs = run(plain)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
