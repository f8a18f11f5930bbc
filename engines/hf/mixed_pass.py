"""Prompt chunks and decode rows in one forward pass: one pass where there were several.

While a prompt is prefilled, the requests that decode wait for a pass of their own after the
chunk's, and prompts that arrive together would each take a pass of their own. A small model's
pass costs mostly what reading its weights costs, and a product of many rows costs less per row
than several of few, so a round's prompt chunks and decode steps go into one pass (vLLM's chunked
prefill does the same): their tokens are one sequence through every product and elementwise op,
and only attention parts them. Each layer's new keys and values are split (:class:`_SplitCache`):
each chunk's go to its own cache, the decode rows' to theirs (the batch's merged cache, or a lone
request's own), and each part attends over its own cache through the attention its own pass
would have run, with the mask its own pass would have had. So every row gets the bits it would
have had in a pass of its own of two rows or more: :func:`check` runs both ways at load and turns
mixed passes off, saying why, where they differ. (A lone decode step's own pass is a one-row
product, which a CPU may round otherwise: see :func:`check`.)

Only plain decode steps ride: one that reads out, encodes features, steers or is deterministic
keeps its pass (and its guarantees) as it was; so does a chunk that steers or is deterministic.
A chunk alone with the decode rows may read out or encode features: the probes take their
products in fixed blocks of rows, so its rows keep their bits there too. Chunks that share a pass
with other chunks ask for nothing but logits. See :func:`check` for the models.
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


@dataclass(frozen=True, slots=True)
class Chunk:
    """A prompt chunk of a mixed pass: ``ids`` fed at positions ``start``... on ``cache`` (which holds
    ``start`` positions), its logits kept for ``rows`` (indices into ``ids``)."""

    ids: Sequence[int]
    cache: Any
    start: int
    rows: Sequence[int]


class _SplitCache:
    """The first chunk's cache, except that each layer's update sends each other chunk's positions to
    that chunk's own cache, and the last ``rows`` positions (the decode rows, one each) to the
    riders' cache; the attention reads every part's keys and values from here."""

    def __init__(self, caches: Sequence[Any], sizes: Sequence[int], riders: Any, rows: int) -> None:
        self._caches, self._sizes, self._riders, self._rows = list(caches), list(sizes), riders, rows
        self.chunk_states: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rider_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getattr__(self, name: str) -> Any:  # the mask and the model ask the first chunk's cache the rest
        return getattr(self._caches[0], name)

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = keys.shape[2] - self._rows
        if self._rows:
            # [1, heads, rows, d] -> [rows, heads, 1, d]: each decode row is a row of its own cache
            self.rider_states[layer_idx] = self._riders.update(
                keys[:, :, end:].transpose(0, 2), values[:, :, end:].transpose(0, 2), layer_idx
            )
        states, begin = [], 0
        for cache, size in zip(self._caches, self._sizes, strict=True):
            part = slice(begin, begin + size)
            states.append(cache.update(keys[:, :, part], values[:, :, part], layer_idx))
            begin += size
        self.chunk_states[layer_idx] = states
        return states[0]


@dataclass(frozen=True, slots=True)
class _Parts:
    """A mixed pass while it runs: its split cache, each chunk's ``[begin, end)`` in the pass's
    sequence with the 4-D mask of its own pass, and the decode rows' (``riders``: there are some)."""

    split: _SplitCache
    bounds: list[tuple[int, int]]
    masks: list[Any]
    riders: bool
    rider_mask: Any


class _Plan(threading.local):
    active: _Parts | None = None  # this thread's mixed pass while it runs


PLAN = _Plan()


def attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attend: Attend, **kw: Any
) -> tuple[torch.Tensor, None]:
    """One layer's attention in a mixed pass: each chunk's queries over its own cache, each decode
    row's over its own, all through ``attend`` (the attention of a pass of their own)."""
    parts = PLAN.active
    assert parts is not None
    states = parts.split.chunk_states[module.layer_idx]
    outs = []
    for (begin, end), (keys, values), mask in zip(parts.bounds, states, parts.masks, strict=True):
        out, _ = attend(module, query[:, :, begin:end], keys, values, mask, **kw)  # [1, chunk, heads, d]
        outs.append(out)
    if parts.riders:
        rider_keys, rider_values = parts.split.rider_states[module.layer_idx]
        rows = query[:, :, parts.bounds[-1][1] :].transpose(0, 2)  # [rows, heads, 1, d]
        tail, _ = attend(module, rows, rider_keys, rider_values, parts.rider_mask, **kw)  # [rows, 1, heads, d]
        outs.append(tail.transpose(0, 1))
    return torch.cat(outs, dim=1), None


def forward(adapter: Any, chunks: Sequence[Chunk], riders: Riders | None = None) -> list[torch.Tensor]:
    """Run ``chunks`` (at least one) and ``riders`` in one pass.

    Returns each chunk's logits for its ``rows`` in the model's dtype (as ``ModelAdapter.forward``);
    the riders' float32 logits ``[riders, vocab]`` (as a batched decode step) go to ``riders.logits``.
    Every cache comes back longer by its tokens; a merged cache's width is the caller's to advance.
    """
    from transformers.masking_utils import create_causal_mask

    from prismgate.engines.hf.adapters import check_cache

    model, device = adapter.model, adapter.device
    config = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    rider_ids, rider_positions = (riders.ids, riders.positions) if riders is not None else ([], [])
    ids: list[int] = []
    fed: list[int] = []  # each token's position
    bounds: list[tuple[int, int]] = []  # each chunk's place in the pass's sequence
    kept: list[int] = []  # the rows whose logits come back
    for chunk in chunks:
        begin = len(ids)
        bounds.append((begin, begin + len(chunk.ids)))
        kept.extend(begin + row for row in chunk.rows)
        ids.extend(chunk.ids)
        fed.extend(range(chunk.start, chunk.start + len(chunk.ids)))
    begin = len(ids)
    ids.extend(rider_ids)
    positions = torch.tensor([fed + list(rider_positions)], device=device)
    # the masks each part's own pass would have had (made before any cache grows)
    masks = [
        create_causal_mask(
            config, torch.empty((1, b - a, 1), dtype=dtype, device=device), None, c.cache, positions[:, a:b]
        )
        for c, (a, b) in zip(chunks, bounds, strict=True)
    ]
    for chunk in chunks:
        check_cache(chunk.cache, chunk.start)
    rider_mask = None
    if riders is not None:
        count = len(rider_ids)
        rider_mask = create_causal_mask(
            config, torch.empty((count, 1, 1), dtype=dtype, device=device), riders.mask, riders.cache,
            positions[0, begin:, None],
        )  # fmt: skip
        if riders.mask is None:  # one request's own cache (a merged one is checked by the batch)
            check_cache(riders.cache, rider_positions[0])
        kept.extend(range(begin, begin + count))
        riders.started = True
    split = _SplitCache(
        [chunk.cache for chunk in chunks], [len(chunk.ids) for chunk in chunks],
        riders.cache if riders is not None else None, len(rider_ids),
    )  # fmt: skip
    PLAN.active = _Parts(split, bounds, masks, riders is not None, rider_mask)
    try:
        out = model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=positions,
            past_key_values=split,
            use_cache=True,
            logits_to_keep=torch.tensor(kept, dtype=torch.long, device=device),
        )
    finally:
        PLAN.active = None
    logits = out.logits[0]
    found, first = [], 0
    for chunk in chunks:
        found.append(logits[first : first + len(chunk.rows)])
        first += len(chunk.rows)
    if riders is not None:
        riders.logits = logits[first:].to(torch.float32)
    return found


OFF = "decode rows run in passes of their own: "  # how every reason riding is off begins
RIDE = "decode rows ride in prompt chunks' passes, and prompts' chunks share them (the same bits, checked at start-up)"
_PROBE = "The quick brown fox jumps over the lazy dog, and the dog sleeps on the warm mat."
_OTHERS = ("Une phrase en français, pour voir", "def f(x):\n    return x * 2\n")


def check(adapter: Any, *, attention_installed: bool, probe: Any = None) -> Riding:
    """Whether prompt chunks and decode rows may share passes on this model and device: its attention
    must run through the engine's own dispatch (``attention_installed``), every layer attend over
    the whole context, and a mixed pass give every row, every key and value and (with the readout
    ``probe``) a lone chunk's readouts the same bits as the passes of their own: a chunk first and
    after a prefix, and two chunks (one after a prefix), with a merged batch of two rows of
    different lengths, and two chunks alone. A lone decode row is not compared: its own pass is a
    one-row product, which a CPU's kernels may round otherwise than any larger one (SmolLM2's
    ``down_proj`` on AVX-512 does, for 8-16% of random rows), so its bits may change when it
    rides, as they do when it joins a batch."""
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
    half = len(tokens) // 2
    cases: tuple[tuple[list[tuple[list[int], int]], list[list[int]], Any], ...] = (
        ([(tokens, half)], others, probe),
        ([(tokens, 0)], others, probe),
        ([(tokens, half), (others[0], 0)], others, None),
        ([(others[1], 0), (tokens, 0)], [], None),
    )
    with torch.inference_mode():
        for prompts, riders, reading in cases:
            try:
                differs = _differs(adapter, prompts, riders, reading)
            except Exception as exc:  # a mixed pass this model cannot run is one it does not get
                differs = f"{type(exc).__name__}: {exc}"
            if differs:
                return Riding(False, OFF + f"the start-up check failed ({differs})")
    return Riding(True, RIDE)


def _differs(adapter: Any, prompts: list[tuple[list[int], int]], sequences: list[list[int]], probe: Any = None) -> str:
    """Run each prompt's ``tokens[start:]`` after its ``tokens[:start]``, with ``sequences`` decoding their
    last token, in passes of their own and in one (a lone chunk read out by ``probe`` if given); what
    differs ("": nothing)."""
    from prismgate.engines.hf.batch_cache import BatchCache

    if probe is not None and len(prompts) != 1:
        raise ValueError("only a chunk alone with the decode rows reads out in a mixed pass")
    outcomes = []
    for mixed in (False, True):
        chunks = []
        for tokens, start in prompts:
            cache = adapter.new_cache()
            if start:
                adapter.forward(tokens[:start], cache, 0, tokens, [], [start - 1])
            chunks.append(Chunk(tokens[start:], cache, start, list(range(len(tokens) - start))))
        caches = []
        for seq in sequences:
            caches.append(adapter.new_cache())
            adapter.forward(seq[:-1], caches[-1], 0, seq, [], [len(seq) - 2])
        positions = [len(seq) - 1 for seq in sequences]
        ids = [seq[-1] for seq in sequences]
        batch = BatchCache(adapter)
        riders = None
        if len(sequences) > 1:
            batch.prepare(caches, positions)
            riders = Riders(ids, positions, batch.merged, batch.mask())
        elif sequences:
            riders = Riders(ids, positions, caches[0])
        if probe is not None:
            probe.enabled = True
        if mixed:
            heads = forward(adapter, chunks, riders)
            tail = riders.logits if riders is not None else None
        else:
            heads = [adapter.forward(c.ids, c.cache, c.start, [], [], c.rows) for c in chunks]
        # a mixed pass's readouts hold the riders' rows too
        read = probe.take()[: len(chunks[0].ids)] if probe is not None else None
        if probe is not None:
            probe.enabled = False
        if not mixed and len(sequences) > 1:
            tail = adapter.forward_batch(ids, batch.merged, positions, batch.width)
        elif not mixed and sequences:
            tail = adapter.forward(ids, caches[0], positions[0], sequences[0], [], [0]).to(torch.float32)
        elif not mixed:
            tail = None
        if len(sequences) > 1:
            batch.advance()
            batch.leave_all()
        outcomes.append((heads, tail, [c.cache for c in chunks] + caches, read))
    (heads, tail, caches, read), (mixed_heads, mixed_tail, mixed_caches, mixed_read) = outcomes
    if not all(torch.equal(a, b) for a, b in zip(heads, mixed_heads, strict=True)):
        return "the chunk's logits"
    if read is not None and not (mixed_read is not None and np.array_equal(read, mixed_read)):
        return "the chunk's readouts"
    if tail is None or mixed_tail is None:
        if tail is not mixed_tail:
            return "the decode rows' logits"
    elif not torch.equal(tail, mixed_tail):
        return "the decode rows' logits"
    for alone, carried in zip(caches, mixed_caches, strict=True):
        for a, b in zip(alone.layers, carried.layers, strict=True):
            if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
                return "keys and values"
    return ""
