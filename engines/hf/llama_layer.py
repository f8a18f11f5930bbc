"""A Llama decoder layer's forward in fewer tensor operations, with transformers' bits.

transformers' ``LlamaDecoderLayer`` runs a decode step's layer as some 180 PyTorch operations
under several layers of Python (keyword-argument decorators, the attention interface's lookup,
each packed sibling copying out its slice); on a CPU at SmolLM2's size they cost about 8% of a
decode step (docs/benchmarks.md, "The transformers engine's CPU kernels"). Each such
layer gets a forward that does the same arithmetic, in the same order and dtypes, with fewer
operations: the packed siblings' one product is read through views, the query and key heads turn
in one rotation (``rotate_half(x) * sin`` is ``x.roll(d / 2) * sin`` with the first half of
``sin`` negated, once per pass: a product's rounding does not depend on the sign).

The layer stays the module it was, called as before: the steering, readout and feature hooks on
it run unchanged, and so do the engine's attention and products (packed, batch-invariant under
the switch). :func:`install` compares both forwards' bits on this machine before it keeps
anything (tests/engines/test_llama_layer.py compares them through the engine).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from prismgate.engines.hf import kv_room, packing

log = logging.getLogger(__name__)

Forward = Callable[..., torch.Tensor]


class _Memo(threading.local):
    # this thread's last pass: its sine (held, so that its identity cannot pass to a new tensor) and
    # that sine with its first half negated, shaped for the heads
    last: tuple[torch.Tensor, torch.Tensor] | None = None


_MEMO = _Memo()


def _signed_sine(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` ``[batch, positions, d]`` with its first half negated, as ``[batch, 1, positions, d]``:
    the same for every layer of a pass, so made once."""
    last = _MEMO.last
    if last is not None and last[0] is sin:
        return last[1]
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
    _MEMO.last = (sin, signed)
    return signed


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` for ``x`` ``[batch, heads, positions, d]``."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _one_product(*siblings: torch.nn.Module) -> packing.Fused | None:
    """The packed product all of ``siblings`` are slices of (side by side in their order), or None."""
    fused = packing.group(siblings[0])
    return fused if fused is not None and all(packing.group(s) is fused for s in siblings) else None


def lean_forward(layer: Any) -> Forward:
    """The forward of ``layer``, a ``LlamaDecoderLayer``: its own arithmetic in fewer operations."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    attn, mlp = layer.self_attn, layer.mlp
    config = attn.config
    dim = attn.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    qkv = _one_product(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up = _one_product(mlp.gate_proj, mlp.up_proj)
    inner = mlp.intermediate_size

    def attention_inputs(h: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch, length = h.shape[:2]
        if qkv is not None:
            x = qkv.whole(h)
            qk = x[..., : (heads + kv_heads) * dim].view(batch, length, heads + kv_heads, dim).transpose(1, 2)
            qk = _rotate(qk, cos, signed)
            value = x[..., (heads + kv_heads) * dim :].view(batch, length, kv_heads, dim).transpose(1, 2)
            return qk[:, :heads], qk[:, heads:], value
        query = attn.q_proj(h).view(batch, length, heads, dim).transpose(1, 2)
        key = attn.k_proj(h).view(batch, length, kv_heads, dim).transpose(1, 2)
        value = attn.v_proj(h).view(batch, length, kv_heads, dim).transpose(1, 2)
        return _rotate(query, cos, signed), _rotate(key, cos, signed), value

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if position_embeddings is None:
            raise TypeError("a Llama layer needs the pass's position embeddings")
        batch, length = hidden_states.shape[:2]
        cos, sin = position_embeddings
        query, key, value = attention_inputs(layer.input_layernorm(hidden_states), cos.unsqueeze(1), _signed_sine(sin))
        if cache is not None:
            key, value = cache.update(key, value, attn.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
        out, _ = attend(
            attn,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0,
            scaling=attn.scaling,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = hidden_states + attn.o_proj(out.reshape(batch, length, -1).contiguous())
        h = layer.post_attention_layernorm(hidden_states)
        if gate_up is not None:
            x = gate_up.whole(h)
            gated = mlp.act_fn(x[..., :inner]) * x[..., inner:]
        else:
            gated = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
        return hidden_states + mlp.down_proj(gated)

    return forward


def install(model: Any) -> str:
    """Give ``model``'s Llama decoder layers :func:`lean_forward` when it gives their bits here; says what it did.

    Call it after packing and before hooks or the batch-invariant kernels are checked: the layers'
    forwards are replaced, the modules and their hooks stay."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", None) or [])
    if not layers or not all(
        type(layer) is LlamaDecoderLayer and type(layer.self_attn) is LlamaAttention and type(layer.mlp) is LlamaMLP
        for layer in layers
    ):
        return "layers: transformers' forward (not a Llama model)"
    forwards = [lean_forward(layer) for layer in layers]
    mismatch = _mismatch(model, layers[0], forwards[0])
    if mismatch is not None:
        log.warning("Llama layers keep transformers' forward: %s", mismatch)
        return f"layers: transformers' forward ({mismatch})"
    for layer, forward in zip(layers, forwards, strict=True):
        layer.forward = forward
    return "layers: prismgate's Llama forward (the same bits as transformers')"


def _mismatch(model: Any, layer: Any, forward: Forward) -> str | None:
    """Where ``forward`` and ``layer``'s own forward part on a prompt of a few tokens and a decode
    step after it (outputs and cached keys and values); None when every bit agrees."""
    config = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(0)
    results = []
    with torch.inference_mode():
        hidden = [torch.randn(1, n, config.hidden_size, generator=generator).to(device, dtype) for n in (5, 1)]
        for run in (layer.forward, forward):
            cache, outs = kv_room.new_cache(config), []
            for start, h in zip((0, 5), hidden, strict=True):
                positions = torch.arange(start, start + h.shape[1], device=device)[None]
                embeddings = model.model.rotary_emb(h, position_ids=positions)
                mask = None if h.shape[1] == 1 else _causal(h.shape[1], device)
                outs.append(
                    run(h, attention_mask=mask, position_ids=positions, cache=cache, position_embeddings=embeddings)
                )
            index = layer.self_attn.layer_idx
            results.append((outs, cache.layers[index].keys, cache.layers[index].values))
    (ours, our_keys, our_values), (theirs, their_keys, their_values) = results[1], results[0]
    if not all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)):
        return "its outputs differ from transformers' on this machine"
    if not (torch.equal(our_keys, their_keys) and torch.equal(our_values, their_values)):
        return "its cached keys and values differ from transformers' on this machine"
    return None


def _causal(length: int, device: Any) -> torch.Tensor:
    """A boolean causal mask ``[1, 1, length, length]`` (True: seen), as transformers builds for SDPA."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
