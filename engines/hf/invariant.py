"""Batch-invariant kernels for the transformers engine: a row's bits never depend on its neighbours.

A deterministic request (``GenerateSpec.deterministic``) must give the same token ids, logprobs
and readouts whatever else shares its forward passes, however its prompt was chunked, and
whether its keys and values were decoded one by one or prefilled at once. Every operation of the
forward pass is row by row already except two, made invariant here while the switch is on:
matrix products run in blocks of exactly ``BLOCK_ROWS`` rows (:func:`install`,
:mod:`prismgate.engines.invariant_rows`), and attention sums over keys in one canonical order
that depends only on the query's absolute position (:func:`invariant_attention`). Off, the
switch costs nothing: attention goes to PyTorch's SDPA and linear layers run unpadded.
docs/determinism.md, "How each source of variation is closed", has the whole story.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from prismgate.engines.hf import chunk_attention, decode_attention, mixed_pass, packing
from prismgate.engines.invariant_rows import BLOCK_ROWS, SWITCH, on_rows

ATTENTION = "prismgate_invariant"  # the name this module registers with transformers' attention interface
BLOCK = 64  # keys per fixed-length partial sum


def _padding_forward(layer: torch.nn.Linear) -> Any:
    """``layer``'s forward, in blocks of ``BLOCK_ROWS`` rows while this thread's switch is on.

    An instance attribute rather than hooks: while the switch is off it costs one attribute
    read, and a module without hooks keeps PyTorch's fast call path.
    """

    linear = packing.product(layer)  # packed or not, the same bits (packing checks that)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return on_rows(x, linear)

    return forward


class _Geometry(NamedTuple):
    """Where each query's keys are: the same for every layer of one forward pass, so computed once."""

    width: int  # key columns after re-basing, a whole number of blocks
    source: torch.Tensor | None  # [batch, 1, width, 1]: the column each re-based key comes from; None: no shift
    hidden: torch.Tensor  # [batch, 1, 1, queries, width] bool: keys a query may not see


class _Memo(threading.local):
    # this thread's last pass: its mask (held, so that its identity cannot pass to a new tensor),
    # its shapes, and their geometry
    last: tuple[torch.Tensor | None, tuple[Any, ...], _Geometry] | None = None


_MEMO = _Memo()


def _geometry(mask: torch.Tensor | None, batch: int, group: int, queries: int, keys: int, device: Any) -> _Geometry:
    """The visible keys of a query are one run of columns: the row's left padding before it, the
    query's future after it (transformers' causal masks with left padding); re-based, key ``j`` of
    the sequence is column ``j`` and a query at absolute position ``p`` sees columns ``[0, p]``."""
    key = (batch, group, queries, keys, device)
    last = _MEMO.last
    if last is not None and last[0] is mask and last[1] == key:
        return last[2]
    if mask is None:  # causal with nothing padded: query i sees keys [0, keys - queries + i]
        first = torch.zeros(batch, dtype=torch.long, device=device)
        counts = torch.arange(keys - queries + 1, keys + 1, device=device).expand(batch, queries)
    else:
        visible = (mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0).expand(batch, queries, keys)
        first = torch.argmax(visible[:, -1].to(torch.int8), dim=-1)
        counts = visible.sum(dim=-1)
    width = -(-(keys - int(first.min())) // BLOCK) * BLOCK
    columns = torch.arange(width, device=device)
    index = (first[:, None] + columns[None, :])[:, None, :, None] if bool((first != 0).any()) else None
    hidden = (columns[None, None, :] >= counts[:, :, None])[:, None, None]
    geometry = _Geometry(width, index, hidden)
    _MEMO.last = (mask, key, geometry)
    return geometry


def _block_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched, ``a`` ``[..., M, K]``) with ``a``'s rows in products of exactly ``BLOCK_ROWS``."""
    m = a.shape[-2]
    blocks = -(-m // BLOCK_ROWS)
    a = F.pad(a, (0, 0, 0, blocks * BLOCK_ROWS - m)).unflatten(-2, (blocks, BLOCK_ROWS))
    out = torch.matmul(a, b.unsqueeze(-3))
    return out.flatten(-3, -2)[..., :m, :]


def invariant_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention in one canonical order (see the module docstring); transformers' interface.

    ``query`` is ``[batch, heads, q, d]``, ``key``/``value`` ``[batch, kv_heads, L, d]``;
    returns ``[batch, q, heads, d]`` in the query's dtype.
    """
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    width, source, hidden = _geometry(attention_mask, batch, group, queries, keys, query.device)

    # keys and values re-based so that column j holds the sequence's key j, padded to whole blocks
    k32 = F.pad(key.to(torch.float32), (0, 0, 0, width))
    v32 = F.pad(value.to(torch.float32), (0, 0, 0, width))
    if source is not None:
        k32 = torch.gather(k32, 2, source.expand(batch, kv_heads, width, dim))
        v32 = torch.gather(v32, 2, source.expand(batch, kv_heads, width, dim))
    else:
        k32, v32 = k32[:, :, :width], v32[:, :, :width]

    # every query row of a key head in products of BLOCK_ROWS rows
    rows = group * queries
    q32 = query.to(torch.float32).reshape(batch, kv_heads, rows, dim)
    scores = _block_matmul(q32, k32.transpose(-1, -2)) * scale
    scores = scores.view(batch, kv_heads, group, queries, width).masked_fill(hidden, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # keys it may not see: exactly 0

    blocks = width // BLOCK
    w = weights.view(batch, kv_heads, rows, blocks, BLOCK)
    total = torch.cumsum(w.sum(dim=-1), dim=-1)[..., -1:]  # [batch, kv_heads, rows, 1], blocks added in order
    parts = _block_matmul(w.transpose(2, 3), v32.view(batch, kv_heads, blocks, BLOCK, dim))
    summed = torch.cumsum(parts, dim=2)[:, :, -1]  # [batch, kv_heads, rows, dim], blocks added in order
    out = (summed / total).view(batch, kv_heads, group, queries, dim)
    return out.reshape(batch, heads, queries, dim).transpose(1, 2).to(query.dtype).contiguous(), None


def _dispatch(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kw: Any
) -> tuple[torch.Tensor, Any]:
    """The attention transformers calls: in a pass where decode rows ride in a prompt chunk, each
    part's own (:mod:`~prismgate.engines.hf.mixed_pass`); else :func:`_attend`."""
    if mixed_pass.PLAN.active is not None:
        return mixed_pass.attention(module, query, key, value, _attend, **kw)
    return _attend(module, query, key, value, attention_mask, **kw)


def _attend(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kw: Any
) -> tuple[torch.Tensor, Any]:
    """The canonical order while the switch is on; else, at one query per row on CPU, in a batch or
    over a long context, :mod:`~prismgate.engines.hf.decode_attention`; a masked chunk on CPU,
    :mod:`~prismgate.engines.hf.chunk_attention`; and SDPA otherwise."""
    if SWITCH.active:
        return invariant_attention(module, query, key, value, attention_mask, **kw)
    if decode_attention.takes(query, key, kw):
        return decode_attention.decode_attention(query, key, value, attention_mask, kw.get("scaling")), None
    if chunk_attention.takes(module, query, key, attention_mask, kw):
        return chunk_attention.chunk_attention(query, key, value, attention_mask, kw.get("scaling")), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


def installed(model: Any) -> bool:
    """Whether ``model``'s attention goes through this module's dispatch (:func:`install` succeeded)."""
    return getattr(model.config.get_text_config(), "_attn_implementation", None) == ATTENTION


def install(model: Any) -> bool:
    """Give ``model`` the switchable kernels; False when its attention does not go through
    transformers' attention interface as SDPA (then the engine refuses deterministic requests)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    config = model.config.get_text_config()
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        return False
    AttentionInterface.register(ATTENTION, _dispatch)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    for layer in model.modules():
        # subclasses (quantized layers) have forwards of their own; fused siblings run in blocks already
        if type(layer) is torch.nn.Linear and not packing.fused(layer):
            layer.forward = _padding_forward(layer)  # type: ignore[method-assign]
    return True
