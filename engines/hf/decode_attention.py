"""Attention for one query per row (a decode step) on CPU, in float32, without SDPA's fixed costs.

PyTorch's CPU SDPA kernel tiles queries and keys for long prompts; at one query per row it pays
for those tiles on every head: 1.6 to 6.9 times this module's time per call at 100 to 3,500 keys
(docs/benchmarks.md, "The transformers engine's CPU kernels"). Here each key head's query heads
are the rows of one float32 product with its keys, then a float32 softmax and one product with
its values: SDPA's accuracy (its accumulators are float32 too), not its bits. Deterministic
requests never come here: their attention is the batch-invariant one.
"""

from __future__ import annotations

from typing import Any

import torch

MIN_KEYS_ALONE = 256  # a single row over fewer keys keeps SDPA


def takes(query: torch.Tensor, key: torch.Tensor, kw: dict[str, Any]) -> bool:
    """Whether :func:`decode_attention` serves this call: one query per row, on CPU, plain softmax
    (no soft cap, no attention sinks: those stay with the model's own attention), and either a
    batch of rows or at least :data:`MIN_KEYS_ALONE` keys. One row over a short context keeps
    SDPA: its fixed cost there is a few percent of a step, and a short answer alone keeps the
    bits it always had (the docs' examples print them)."""
    if query.shape[2] != 1 or query.device.type != "cpu" or kw.get("softcap") or kw.get("s_aux") is not None:
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
    scale = dim**-0.5 if scaling is None else scaling
    q32 = query.to(torch.float32).view(batch, kv_heads, group, dim)  # a key head's query heads as rows
    scores = torch.matmul(q32, key.to(torch.float32).transpose(-1, -2)) * scale  # [batch, kv_heads, group, L]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1, -keys:]
        mask = mask.reshape(batch, 1, 1, keys) if mask.shape[1] == 1 else mask.reshape(batch, kv_heads, group, keys)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(torch.float32)
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights, value.to(torch.float32))  # [batch, kv_heads, group, d]
    return out.view(batch, 1, heads, dim).to(query.dtype)
