"""Decode rows riding in a prompt chunk's forward pass: one pass where there were two.

While a prompt is prefilled, the requests that decode wait for a pass of their own after the
chunk's. A small model's pass costs mostly what reading its weights costs, whatever its rows, so
their tokens go into the chunk's pass instead (vLLM's chunked prefill does the same): the chunk's
tokens and theirs are one sequence through every product and elementwise op, and only attention
parts them. Each layer's new keys and values are split (:class:`_SplitCache`): the chunk's go to
its own cache, the decode rows' to theirs (the batch's merged cache, or a lone request's own), and
each part attends over its own cache through the attention its own pass would have run, with the
mask its own pass would have had. So every row gets the bits it would have had in a pass of its
own: :func:`check` runs both ways at load and turns riding off, saying why, where they differ.

Only plain decode steps ride: one that reads out, encodes features, steers or is deterministic
keeps its pass (and its guarantees) as it was; so does a chunk that steers or is deterministic.
A chunk that reads out or encodes features carries them: the probes take their products in fixed
blocks of rows, so the chunk's rows keep their bits there too. See :func:`check` for the models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Attend = Callable[..., tuple[torch.Tensor, Any]]


@dataclass(eq=False)
class Riders:
    """The decode rows of a pass: ``ids[j]`` fed at ``positions[j]`` on ``cache`` (a merged batch cache,
    its row ``j`` ending at ``width``, or with one row a request's own cache), ``mask`` the 2-D padding
    mask their own pass gives the model (None: nothing padded). ``logits`` (float32 ``[rows, vocab]``)
    is set once a chunk's pass has carried them."""

    ids: list[int]
    positions: list[int]
    cache: Any
    mask: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    started: bool = False  # a pass began writing their keys and values (failing, it leaves them half-written)


@dataclass(frozen=True, slots=True)
class Riding:
    """Whether decode rows ride in prompt chunks' passes here, and why (or why not)."""

    enabled: bool
    reason: str


class _Plan(threading.local):
    # this thread's mixed pass while it runs: the split cache, the chunk's length, each part's 4-D mask
    active: tuple[_SplitCache, int, Any, Any] | None = None


PLAN = _Plan()


class _SplitCache:
    """The chunk's cache, except that each layer's update sends its last ``rows`` positions (the decode
    rows, one each) to the riders' cache; the attention reads their keys and values from here."""

    def __init__(self, chunk: Any, riders: Any, rows: int) -> None:
        self._chunk, self._riders, self._rows = chunk, riders, rows
        self.rider_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getattr__(self, name: str) -> Any:  # the mask and the model ask the chunk's cache the rest
        return getattr(self._chunk, name)

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = keys.shape[2] - self._rows
        # [1, heads, rows, d] -> [rows, heads, 1, d]: each decode row is a row of its own cache
        self.rider_states[layer_idx] = self._riders.update(
            keys[:, :, chunk:].transpose(0, 2), values[:, :, chunk:].transpose(0, 2), layer_idx
        )
        return self._chunk.update(keys[:, :, :chunk], values[:, :, :chunk], layer_idx)


def attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attend: Attend, **kw: Any
) -> tuple[torch.Tensor, None]:
    """One layer's attention in a mixed pass: the chunk's queries over ``key``/``value`` (its cache), each
    decode row's over its own, both through ``attend`` (the attention of a pass of their own)."""
    plan = PLAN.active
    assert plan is not None
    split, chunk, chunk_mask, rider_mask = plan
    rider_keys, rider_values = split.rider_states[module.layer_idx]
    head, _ = attend(module, query[:, :, :chunk], key, value, chunk_mask, **kw)  # [1, chunk, heads, d]
    rows = query[:, :, chunk:].transpose(0, 2)  # [rows, heads, 1, d]
    tail, _ = attend(module, rows, rider_keys, rider_values, rider_mask, **kw)  # [rows, 1, heads, d]
    return torch.cat([head, tail.transpose(0, 1)], dim=1), None


def forward(
    adapter: Any, ids: Sequence[int], cache: Any, start: int, rows: Sequence[int], riders: Riders
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the chunk ``ids`` (positions ``start``... on ``cache``) and ``riders`` in one pass.

    Returns the chunk's logits for ``rows`` in the model's dtype (as ``ModelAdapter.forward``) and
    the riders' float32 logits ``[riders, vocab]`` (as a batched decode step). Both caches come
    back longer by their tokens; a merged cache's width is the caller's to advance.
    """
    from transformers.masking_utils import create_causal_mask

    from prismgate.engines.hf.adapters import check_cache

    model, device = adapter.model, adapter.device
    config = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    chunk, count = len(ids), len(riders.ids)
    positions = torch.tensor([[*range(start, start + chunk), *riders.positions]], dtype=torch.long, device=device)
    rider_positions = positions[0, chunk:, None]
    # the masks each part's own pass would have had (made before either cache grows)
    chunk_mask = create_causal_mask(
        config, torch.empty((1, chunk, 1), dtype=dtype, device=device), None, cache, positions[:, :chunk]
    )
    rider_mask = create_causal_mask(
        config, torch.empty((count, 1, 1), dtype=dtype, device=device), riders.mask, riders.cache, rider_positions
    )
    check_cache(cache, start)
    if riders.mask is None:  # one request's own cache (a merged one is checked by the batch)
        check_cache(riders.cache, riders.positions[0])
    split = _SplitCache(cache, riders.cache, count)
    riders.started = True
    PLAN.active = (split, chunk, chunk_mask, rider_mask)
    try:
        out = model(
            input_ids=torch.tensor([[*ids, *riders.ids]], dtype=torch.long, device=device),
            position_ids=positions,
            past_key_values=split,
            use_cache=True,
            logits_to_keep=torch.tensor([*rows, *range(chunk, chunk + count)], dtype=torch.long, device=device),
        )
    finally:
        PLAN.active = None
    logits = out.logits[0]
    riders.logits = logits[len(rows) :].to(torch.float32)
    return logits[: len(rows)], riders.logits


OFF = "decode rows run in passes of their own: "  # how every reason riding is off begins
_PROBE = "The quick brown fox jumps over the lazy dog, and the dog sleeps on the warm mat."
_OTHERS = ("Une phrase en français, pour voir", "def f(x):\n    return x * 2\n")


def check(adapter: Any, *, attention_installed: bool, probe: Any = None) -> Riding:
    """Whether decode rows may ride in prompt chunks on this model and device: its attention must run
    through the engine's own dispatch (``attention_installed``), every layer attend over the whole
    context, and a chunk's pass carrying decode rows give every row, every key and value and (with
    the readout ``probe``) the chunk's readouts the same bits as the passes of their own (a chunk
    after a prefix with a lone row, and a first chunk with a merged batch of two rows of different
    lengths)."""
    from prismgate.engines.hf import kv_room
    from prismgate.engines.hf.adapters import ModelAdapter

    if not attention_installed:
        return Riding(False, OFF + "the engine's attention is not installed here")
    if type(adapter).extra_inputs is not ModelAdapter.extra_inputs:
        return Riding(False, OFF + "this model's chunks take inputs of their own")
    if not all(type(layer) is kv_room.RoomLayer for layer in adapter.new_cache().layers):
        return Riding(False, OFF + "some layers attend over a window")
    tokens = list(adapter.tokenizer(_PROBE)["input_ids"])
    others = [list(adapter.tokenizer(text)["input_ids"]) for text in _OTHERS]
    with torch.inference_mode():
        for start, riders in ((len(tokens) // 2, others[:1]), (0, others)):
            differs = _differs(adapter, tokens, start, riders, probe)
            if differs:
                return Riding(False, OFF + f"the start-up check failed ({differs})")
    return Riding(True, "decode rows ride in prompt chunks' passes (the same bits, checked at start-up)")


def _differs(adapter: Any, tokens: list[int], start: int, sequences: list[list[int]], probe: Any = None) -> str:
    """Run ``tokens[start:]`` after ``tokens[:start]`` with ``sequences`` decoding their last token, in
    passes of their own and in one (the chunk read out by ``probe`` if given); what differs ("": nothing)."""
    from prismgate.engines.hf.batch_cache import BatchCache

    chunk, rows = tokens[start:], list(range(len(tokens) - start))
    outcomes = []
    for mixed in (False, True):
        cache = adapter.new_cache()
        if start:
            adapter.forward(tokens[:start], cache, 0, tokens, [], [start - 1])
        caches = []
        for seq in sequences:
            caches.append(adapter.new_cache())
            adapter.forward(seq[:-1], caches[-1], 0, seq, [], [len(seq) - 2])
        positions = [len(seq) - 1 for seq in sequences]
        ids = [seq[-1] for seq in sequences]
        batch = BatchCache(adapter)
        if len(sequences) > 1:
            batch.prepare(caches, positions)
            riders = Riders(ids, positions, batch.merged, batch.mask())
        else:
            riders = Riders(ids, positions, caches[0])
        if probe is not None:
            probe.enabled = True
        if mixed:
            head, tail = forward(adapter, chunk, cache, start, rows, riders)
        else:
            head = adapter.forward(chunk, cache, start, tokens, [], rows)
        read = probe.take()[: len(chunk)] if probe is not None else None  # a mixed pass's holds the riders' rows too
        if probe is not None:
            probe.enabled = False
        if not mixed and len(sequences) > 1:
            tail = adapter.forward_batch(ids, batch.merged, positions, batch.width)
        elif not mixed:
            tail = adapter.forward(ids, caches[0], positions[0], sequences[0], [], [0]).to(torch.float32)
        if len(sequences) > 1:
            batch.advance()
            batch.leave_all()
        outcomes.append((head, tail, [cache, *caches], read))
    (head, tail, caches, read), (mixed_head, mixed_tail, mixed_caches, mixed_read) = outcomes
    if not torch.equal(head, mixed_head):
        return "the chunk's logits"
    if read is not None and not (mixed_read is not None and np.array_equal(read, mixed_read)):
        return "the chunk's readouts"
    if not torch.equal(tail, mixed_tail):
        return "the decode rows' logits"
    for alone, carried in zip(caches, mixed_caches, strict=True):
        for a, b in zip(alone.layers, carried.layers, strict=True):
            if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
                return "keys and values"
    return ""
