"""Linear layers whose bfloat16 weights are packed once for oneDNN, instead of on every call.

On CPU a bfloat16 linear layer runs as a oneDNN matrix product that reorders its weight into
oneDNN's blocked layout on every call; at one decode row the reorder costs about as much as the
product (docs/benchmarks.md, "The transformers engine's CPU kernels"). Packed at load, the product runs the same
kernel with the same order of additions, so every bit stays what it was: :func:`pack` checks
that on this CPU for each layer shape before it keeps anything, and otherwise leaves the model as
it was and says why (float32's eager products are MKL's, not oneDNN's: never packed).

Sibling layers that read the same input (a layer's query, key and value projections; an MLP's
gate and up projections) are packed as one product (:class:`Fused`): fewer, larger products,
whose bits the same check compares with each layer's own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from prismgate.engines.invariant_rows import on_rows

log = logging.getLogger(__name__)

Product = Callable[[torch.Tensor], torch.Tensor]
CHECK_ROWS = (1, 2, 3, 8, 17, 64, 129)  # row counts of the start-up comparison: decode, batches, chunks
_PRODUCT = "_prismgate_packed_product"  # the layer attribute holding its packed product
_GROUP = "_prismgate_fused"  # on a layer whose product is a slice of its siblings' one: their Fused
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # names that read one input


@dataclass(frozen=True, slots=True)
class Packing:
    """What :func:`pack` did: how many layers it packed (0: none), why, and in how many seconds."""

    layers: int
    reason: str
    seconds: float = 0.0
    fused: int = 0  # groups of sibling layers packed as one product


class Fused:
    """Sibling linear layers that read the same input, packed as one product with their outputs
    side by side.

    The first sibling called with an input runs the product for all of them; each other sibling
    called with that same tensor takes its slice of the result (a copy: no part of the shared
    output outlives the call in a KV cache). Called with any other tensor, a sibling runs the
    product anew: a caller that feeds them different inputs still gets each layer's own product.
    (Inference tensors keep no version counter, so a tensor changed in place between two
    siblings' calls would not be seen: the models' forwards never do that.)
    While the batch-invariant switch is on, the product runs in its fixed blocks of rows.
    """

    def __init__(self, layers: tuple[torch.nn.Linear, ...]) -> None:
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias for layer in layers]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        whole = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        whole.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            whole.bias = torch.nn.Parameter(bias, requires_grad=False)
        self._product = _packed_product(whole)
        ends = torch.tensor([layer.out_features for layer in layers]).cumsum(0).tolist()
        self._bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        self._last = threading.local()  # per model thread: (input, output, siblings yet to take theirs)

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """Every sibling's product of ``x``, side by side in their order (views of it are each one's)."""
        return on_rows(x, self._product)

    def part(self, index: int) -> Product:
        """The product of the ``index``-th sibling."""
        start, end = self._bounds[index]

        def forward(x: torch.Tensor) -> torch.Tensor:
            last = getattr(self._last, "value", None)
            if last is not None and last[0] is x and index in last[2]:
                out, waiting = last[1], last[2]
                waiting.discard(index)
                if not waiting:
                    self._last.value = None
            else:
                out = self.whole(x)
                self._last.value = (x, out, set(range(len(self._bounds))) - {index})
            return out[..., start:end].contiguous()

        return forward


def pack(model: Any, *, enabled: bool = True, fuse: bool = True) -> Packing:
    """Pack the weights of ``model``'s linear layers when that keeps their products' bits here.

    Each packed layer's ``forward`` becomes the packed product; :func:`product` gives it to code
    that wraps the layer (the batch-invariant kernels). The packed copy replaces the weight, which
    becomes a meta tensor of the same shape and dtype (reading it fails loudly), unless another
    module shares it. With ``fuse``, siblings that read one input share one product
    (:class:`Fused`). Slow (a copy of the weights): off the loop.
    """
    started = time.perf_counter()
    layers = [layer for layer in model.modules() if type(layer) is torch.nn.Linear]
    refusal = _refusal(layers, enabled)
    if refusal is not None:
        return Packing(0, refusal)
    shared = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    groups = _sibling_groups(model, shared) if fuse else []
    try:  # oneDNN refuses where the CPU has no bf16 path (AVX2 alone): "... needs the cpu support ..."
        products: dict[int, Product] = {}
        fused_groups = [(group, Fused(group)) for group in groups]
        for group, fused in fused_groups:
            products.update((id(layer), fused.part(i)) for i, layer in enumerate(group))
        products.update((id(layer), _packed_product(layer)) for layer in layers if id(layer) not in products)
        places = {
            id(layer): (tuple(m.out_features for m in group), i) for group in groups for i, layer in enumerate(group)
        }
        mismatch = _first_mismatch(layers, products, places)
    except RuntimeError as exc:
        return Packing(0, f"not packed: oneDNN cannot pack here: {str(exc).splitlines()[0]}")
    if mismatch is not None:
        return Packing(0, f"not packed: {mismatch}")
    for group, fused in fused_groups:
        for layer in group:
            setattr(layer, _GROUP, fused)
    for layer in layers:
        layer.forward = products[id(layer)]  # type: ignore[method-assign,assignment]
        setattr(layer, _PRODUCT, products[id(layer)])
        if shared[id(layer.weight)] == 1:  # a tied weight (an LM head's embedding) stays: its other user reads it
            layer.weight = torch.nn.Parameter(torch.empty_like(layer.weight, device="meta"), requires_grad=False)
    packing = Packing(
        len(layers),
        "packed: the same bits as the eager products on this CPU",
        time.perf_counter() - started,
        len(groups),
    )
    log.info(
        "packed the weights of %d linear layers for oneDNN (%d groups of siblings as one product) in %.2f s",
        packing.layers,
        packing.fused,
        packing.seconds,
    )
    return packing


def product(layer: torch.nn.Linear) -> Product:
    """``layer``'s matrix product: its packed one when :func:`pack` packed it, else ``F.linear``."""
    packed: Product | None = getattr(layer, _PRODUCT, None)
    if packed is not None:
        return packed
    return lambda x: F.linear(x, layer.weight, layer.bias)


def fused(layer: torch.nn.Linear) -> bool:
    """Whether ``layer``'s product is a slice of its siblings' one (:class:`Fused`): it runs in
    the batch-invariant blocks by itself, and must not be wrapped in them again."""
    return group(layer) is not None


def group(layer: torch.nn.Module) -> Fused | None:
    """The :class:`Fused` product ``layer`` is a slice of, or None."""
    found: Fused | None = getattr(layer, _GROUP, None)
    return found


def _sibling_groups(model: Any, shared: Counter[int]) -> list[tuple[torch.nn.Linear, ...]]:
    """Each module's children named as one of :data:`FUSED_SIBLINGS`, when all are plain linear
    layers with the same input width, all with a bias or none, and none sharing its weight."""
    groups = []
    for module in model.modules():
        for names in FUSED_SIBLINGS:
            group = tuple(getattr(module, name, None) for name in names)
            if not all(type(layer) is torch.nn.Linear for layer in group):
                continue
            linears = tuple(layer for layer in group if isinstance(layer, torch.nn.Linear))
            if (
                len({layer.in_features for layer in linears}) == 1
                and len({layer.bias is None for layer in linears}) == 1
                and all(shared[id(layer.weight)] == 1 for layer in linears)
            ):
                groups.append(linears)
    return groups


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


def _first_mismatch(
    layers: list[torch.nn.Linear], products: dict[int, Product], places: dict[int, tuple[tuple[int, ...], int]]
) -> str | None:
    """The first layer shape whose packed products differ from ``F.linear``'s, as a sentence; None when none.

    ``places``: a :class:`Fused` sibling's group (its widths) and its place in it; a sibling is
    checked apart from a lone layer of its shape, since its product has other columns beside it."""
    seen: set[tuple[int, int, bool, tuple[tuple[int, ...], int] | None]] = set()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for layer in layers:
            shape = (layer.in_features, layer.out_features, layer.bias is not None, places.get(id(layer)))
            if shape in seen:
                continue
            seen.add(shape)
            for rows in CHECK_ROWS:
                x = torch.randn(rows, layer.in_features, generator=generator).to(torch.bfloat16)
                if not torch.equal(products[id(layer)](x), F.linear(x, layer.weight, layer.bias)):
                    size = f"{layer.in_features}x{layer.out_features}"
                    return f"packed products of a {size} layer at {rows} rows differ from the eager ones on this CPU"
    return None
