"""Attention for a prompt chunk after a cached prefix on CPU: PyTorch's SDPA over the key heads as they are.

A chunk after a cached prefix always passes a mask, and with a mask transformers' SDPA path
copies every key and value head once per query head it serves (``repeat_kv``): a copy of the
whole cache, per layer, per chunk, whatever the chunk's size. Deep in a long prompt that is a
fixed cost that small chunks pay again and again (docs/benchmarks.md, "Waiting behind a long
prompt"). PyTorch's CPU kernel takes grouped heads itself (``enable_gqa``) and gives the same
bits (tests/engines/test_chunk_attention.py), so this is the same attention without the copy.
Likewise the kernel turns a boolean mask into an additive one on every call, that is every
layer; here that is done once per forward pass, which passes every layer the same mask.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F


class _Memo(threading.local):
    # this thread's last boolean mask (held, so that its identity cannot pass to a new tensor),
    # the dtype it was made additive in, and that additive mask
    last: tuple[torch.Tensor, torch.dtype, torch.Tensor] | None = None


_MEMO = _Memo()


def takes(module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Any, kw: dict[str, Any]) -> bool:
    """Whether :func:`chunk_attention` serves this call: several queries on CPU with a mask, query
    heads sharing key heads, plain softmax (no soft cap, no sinks, no position bias), no dropout."""
    return (
        query.device.type == "cpu"
        and query.shape[2] > 1
        and attention_mask is not None
        and query.shape[1] > key.shape[1]
        and not getattr(module, "training", False)
        and not kw.get("dropout")
        and not kw.get("softcap")
        and kw.get("s_aux") is None
        and kw.get("position_bias") is None
    )


def chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """``query`` ``[batch, heads, q, d]`` over ``key``/``value`` ``[batch, kv_heads, L, d]`` with
    ``attention_mask`` (boolean, True: seen, or additive); returns ``[batch, q, heads, d]``, as
    transformers' attention functions do."""
    mask = _additive(attention_mask, query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as the kernel would make it: 0 where seen, -inf elsewhere, in ``dtype`` (the same
    bits as passing the boolean mask), made once per forward pass."""
    if mask.dtype != torch.bool:
        return mask
    last = _MEMO.last
    if last is not None and last[0] is mask and last[1] == dtype:
        return last[2]
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    _MEMO.last = (mask, dtype, additive)
    return additive
