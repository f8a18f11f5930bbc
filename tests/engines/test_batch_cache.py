"""The merged KV cache kept across batched decode steps gives the same bits as merging every step.

The reference is the batched step as it was (:func:`tests.engines.batch_reference.per_step_merge`:
each member's whole cache merged into a new batch cache and copied back, every step). The same
sequences run through both, with members joining, leaving (the longest among them, so the
merge's padding shrinks), coming back in another row order and stepping on their own in between;
every step's logits and, at the end, every cache's keys and values must be equal to the bit, with
the batch-invariant kernels off and on, on the tests' tiny model and on SmolLM2 in bf16.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from prismgate.engines.hf.batch_cache import BatchCache
from prismgate.engines.hf.loading import load
from prismgate.engines.invariant_rows import SWITCH
from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
from tests.engines.batch_reference import per_step_merge

LENGTHS = {"a": 9, "b": 17, "c": 12, "d": 30}
# who decodes together at each step ("a" alone: a step of its own); ends with all of them
SCHEDULE = ["abc", "abc", "acd", "a", "cd", "dcb", "cb", "cb", "b", "abcd", "abcd"]


def run_schedule(adapter: Any, caches: dict[str, Any], batched: Any) -> list[torch.Tensor]:
    """Feed a token to each sequence named at each step of :data:`SCHEDULE`; the logits of every step."""
    out = []
    for step, names in enumerate(SCHEDULE):
        ids = [40 + 7 * step + ord(name) % 5 for name in names]
        positions = [LENGTHS[name] + sum(name in earlier for earlier in SCHEDULE[:step]) for name in names]
        if len(names) == 1:
            (name,) = names
            out.append(adapter_forward(adapter, ids[0], caches[name], positions[0], batched))
        else:
            out.append(batched(ids, [caches[n] for n in names], positions))
    return out


def adapter_forward(adapter: Any, token: int, cache: Any, position: int, batched: Any) -> torch.Tensor:
    leave = getattr(batched, "__self__", None)
    if isinstance(leave, BatchCache):
        leave.leave(cache)  # as the engine's step of its own does
    return adapter.forward([token], cache, position, [], [], [0])


@pytest.mark.parametrize("invariant", [False, True], ids=["sdpa", "invariant"])
@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_a_merge_kept_across_steps_gives_the_bits_of_a_merge_per_step(
    model: str, invariant: bool, tiny_model_dir: Path
) -> None:
    path = tiny_model_dir if model == "tiny" else default_model_path()
    adapter = load(
        path, model_id=DEFAULT_MODEL_ID, concept_pack=None, device="cpu", dtype="auto", max_model_len=None
    ).adapter
    with torch.inference_mode(), SWITCH.on(invariant):
        prefilled = {}
        for name, length in LENGTHS.items():
            cache = adapter.new_cache()
            adapter.forward([30 + (i * 13 + ord(name)) % 60 for i in range(length)], cache, 0, [], [], [0])
            prefilled[name] = cache
        ours, theirs = copy.deepcopy(prefilled), copy.deepcopy(prefilled)
        kept = BatchCache(adapter)
        got = run_schedule(adapter, ours, kept.step)
        kept.leave_all()
        want = run_schedule(
            adapter, theirs, lambda ids, caches, positions: per_step_merge(adapter, ids, caches, positions)
        )
    assert kept.regroups == 6  # once per change of who decodes together, not once per step
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), (step, SCHEDULE[step])
    for name in LENGTHS:
        for mine, ref in zip(ours[name].layers, theirs[name].layers, strict=True):
            assert mine.keys.is_contiguous() and torch.equal(mine.keys, ref.keys), name
            assert torch.equal(mine.values, ref.values), name


def test_a_request_merged_into_the_batch_holds_no_keys_of_its_own(tiny_model_dir: Path) -> None:
    """While merged, its own cache is empty: a step of its own on it would fail, never run on stale keys."""
    adapter = load(
        tiny_model_dir, model_id="tiny", concept_pack=None, device="cpu", dtype="auto", max_model_len=None
    ).adapter
    with torch.inference_mode():
        caches = []
        for length in (5, 8):
            cache = adapter.new_cache()
            adapter.forward(list(range(40, 40 + length)), cache, 0, [], [], [0])
            caches.append(cache)
        batch = BatchCache(adapter)
        batch.step([50, 51], caches, [5, 8])
        assert all(cache.get_seq_length() == 0 for cache in caches) and batch.holds(caches[0])
        with pytest.raises(RuntimeError, match="holds 0 tokens, expected 6"):
            adapter.forward([52], caches[0], 6, [], [], [0])
        with pytest.raises(RuntimeError, match="holds 6 tokens of a request at 7"):
            batch.step([52, 53], caches, [7, 9])
        batch.leave(caches[1])
        assert caches[1].get_seq_length() == 9 and not batch.holds(caches[1])
        batch.drop(caches[0])
        assert batch.merged is None and batch.rows == []
