"""Attention for one query per row (a decode step) on CPU: SDPA over each key head's query heads.

transformers hands SDPA a grouped-query decode step without a mask (one row) as ``enable_gqa``,
and PyTorch's CPU kernel then runs every query head apart (as it does given the keys repeated
per query head): three to seven times the time of the same kernel given each key head's query
heads as the rows of one query block (docs/benchmarks.md, "The transformers engine's CPU
kernels"). Here a decode step of several rows, or of one row over a long context, runs that
way: SDPA's kernel and accuracy in its fastest layout, faster at every size measured than the
float32 kernel this module had (:func:`takes` says why one row over a short context does not).
Deterministic requests never come here: their attention is the batch-invariant one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

MIN_KEYS_ALONE = 256  # a single row over fewer keys keeps SDPA as transformers calls it


def takes(query: torch.Tensor, key: torch.Tensor, kw: dict[str, Any]) -> bool:
    """Whether :func:`decode_attention` serves this call: one query per row, on CPU, a plain
    softmax (no soft cap, no attention sinks: those stay with the model's own attention), and
    either a batch of rows or at least :data:`MIN_KEYS_ALONE` keys. One row over a short context
    keeps the bits it always had (the docs quote steered answers whose near ties would flip on
    other ones), at about 3 ms of a 30 ms step on SmolLM2."""
    if query.shape[2] != 1 or query.device.type != "cpu" or kw.get("softcap") or kw.get("s_aux") is not None:
        return False
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        return False
    return query.shape[0] > 1 or key.shape[2] >= MIN_KEYS_ALONE


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scaling + mask) v`` for ``query`` ``[batch, heads, 1, d]`` and ``key``/``value``
    ``[batch, kv_heads, L, d]``; ``attention_mask`` ``[batch, 1 or heads, 1, L]``, boolean (True:
    seen) or additive. Returns ``[batch, 1, heads, d]`` in the query's dtype, as transformers'
    attention functions do."""
    batch, heads, _, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    packed = query.reshape(batch, kv_heads, group, dim)  # a key head's query heads as one block of rows
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, -keys:]
        mask = mask if mask.shape[1] == 1 else mask.reshape(batch, kv_heads, group, keys)
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, 1, heads, dim)
