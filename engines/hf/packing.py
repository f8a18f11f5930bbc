"""Linear layers whose bfloat16 weights are packed once for oneDNN, instead of on every call.

On CPU a bfloat16 linear layer runs as a oneDNN matrix product that reorders its weight into
oneDNN's blocked layout on every call; at one decode row the reorder costs about as much as the
product (docs/benchmarks.md, "The transformers engine's CPU kernels"). Packed at load, the product runs the same
kernel with the same order of additions, so every bit stays what it was: :func:`pack` checks
that on this CPU for each layer shape before it keeps anything, and otherwise leaves the model as
it was and says why (float32's eager products are MKL's, not oneDNN's: never packed).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

Product = Callable[[torch.Tensor], torch.Tensor]
CHECK_ROWS = (1, 2, 3, 8, 17, 64, 129)  # row counts of the start-up comparison: decode, batches, chunks
_PRODUCT = "_prismgate_packed_product"  # the layer attribute holding its packed product


@dataclass(frozen=True, slots=True)
class Packing:
    """What :func:`pack` did: how many layers it packed (0: none), why, and in how many seconds."""

    layers: int
    reason: str
    seconds: float = 0.0


def pack(model: Any, *, enabled: bool = True) -> Packing:
    """Pack the weights of ``model``'s linear layers when that keeps their products' bits here.

    Each packed layer's ``forward`` becomes the packed product; :func:`product` gives it to code
    that wraps the layer (the batch-invariant kernels). The packed copy replaces the weight, which
    becomes a meta tensor of the same shape and dtype (reading it fails loudly), unless another
    module shares it. Slow (a copy of the weights): off the loop.
    """
    started = time.perf_counter()
    layers = [layer for layer in model.modules() if type(layer) is torch.nn.Linear]
    refusal = _refusal(layers, enabled)
    if refusal is not None:
        return Packing(0, refusal)
    try:  # oneDNN refuses where the CPU has no bf16 path (AVX2 alone): "... needs the cpu support ..."
        products = {id(layer): _packed_product(layer) for layer in layers}
        mismatch = _first_mismatch(layers, products)
    except RuntimeError as exc:
        return Packing(0, f"not packed: oneDNN cannot pack here: {str(exc).splitlines()[0]}")
    if mismatch is not None:
        return Packing(0, f"not packed: {mismatch}")
    shared = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for layer in layers:
        layer.forward = products[id(layer)]  # type: ignore[method-assign,assignment]
        setattr(layer, _PRODUCT, products[id(layer)])
        if shared[id(layer.weight)] == 1:  # a tied weight (an LM head's embedding) stays: its other user reads it
            layer.weight = torch.nn.Parameter(torch.empty_like(layer.weight, device="meta"), requires_grad=False)
    packing = Packing(
        len(layers), "packed: the same bits as the eager products on this CPU", time.perf_counter() - started
    )
    log.info("packed the weights of %d linear layers for oneDNN in %.2f s", packing.layers, packing.seconds)
    return packing


def product(layer: torch.nn.Linear) -> Product:
    """``layer``'s matrix product: its packed one when :func:`pack` packed it, else ``F.linear``."""
    packed: Product | None = getattr(layer, _PRODUCT, None)
    if packed is not None:
        return packed
    return lambda x: F.linear(x, layer.weight, layer.bias)


def _refusal(layers: list[torch.nn.Linear], enabled: bool) -> str | None:
    if not enabled:
        return "not packed: packed_weights = false"
    if not layers:
        return "not packed: the model has no plain linear layers"
    weight = layers[0].weight
    if weight.device.type != "cpu":
        return f"not packed: the weights are on {weight.device.type}, not the CPU"
    if any(layer.weight.dtype != torch.bfloat16 for layer in layers):
        dtype = str(weight.dtype).removeprefix("torch.")
        return f"not packed: the weights are {dtype}; only bfloat16 products are oneDNN's"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "not packed: this torch has no oneDNN"
    return None


def _packed_product(layer: torch.nn.Linear) -> Product:
    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)
    bias = None if layer.bias is None else layer.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not torch.bfloat16 or x.requires_grad:
            raise TypeError(f"a packed bfloat16 linear layer takes bfloat16 input without gradients; got {x.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _first_mismatch(layers: list[torch.nn.Linear], products: dict[int, Product]) -> str | None:
    """The first layer shape whose packed products differ from ``F.linear``'s, as a sentence; None when none."""
    seen: set[tuple[int, int, bool]] = set()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for layer in layers:
            shape = (layer.in_features, layer.out_features, layer.bias is not None)
            if shape in seen:
                continue
            seen.add(shape)
            for rows in CHECK_ROWS:
                x = torch.randn(rows, layer.in_features, generator=generator).to(torch.bfloat16)
                if not torch.equal(products[id(layer)](x), F.linear(x, layer.weight, layer.bias)):
                    size = f"{layer.in_features}x{layer.out_features}"
                    return f"packed products of a {size} layer at {rows} rows differ from the eager ones on this CPU"
    return None
