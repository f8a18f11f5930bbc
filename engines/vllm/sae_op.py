"""SAE features inside vLLM's compiled forward pass: encode, threshold and top-k on the device.

Each decoder layer an SAE reads after calls the custom op ``prismgate::features`` after its
steering and readout: it encodes every row's stream in float32 (:mod:`.encoder`, the arithmetic
of :mod:`prismgate.engines.sae.encode`) and writes only what leaves the device, each row's top
``K`` ids and activations and its watched ids' activations, into buffers allocated once, so a
captured graph writes the same memory at every replay. Buffers, flags and why the product is not
padded: docs/vllm.md, "SAE features in the graph".

Only torch (and the core) is imported here: this runs inside vLLM's worker process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prismgate.core.features import MAX_WATCHED_FEATURES
from prismgate.engines.introspect import decoder_layers
from prismgate.engines.vllm.capture import recording
from prismgate.engines.vllm.encoder import JUMPRELU, TOPK, SaeWeights, pre_activations
from prismgate.engines.vllm.features import top_width

PREFIX = "prismgate_sae_"  # the buffers' names on the layer


@torch.library.custom_op(
    "prismgate::features",
    mutates_args=("ids", "values", "watched"),
    schema=(
        "(Tensor hidden, Tensor? residual, Tensor W_enc, Tensor b_enc, Tensor b_dec, Tensor threshold, "
        "Tensor(a!) ids, Tensor(b!) values, Tensor watch, Tensor(c!) watched, Tensor flags, int arch, int k, "
        "int top) -> ()"
    ),
)
def features(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    W_enc: torch.Tensor,
    b_enc: torch.Tensor,
    b_dec: torch.Tensor,
    threshold: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    watch: torch.Tensor,
    watched: torch.Tensor,
    flags: torch.Tensor,
    arch: int,
    k: int,
    top: int,
) -> None:
    """Write each row's top ``top`` features and its watched activations into the buffers.

    ``b_dec`` is zero when the SAE does not subtract it from its input; ``threshold`` is empty
    unless ``arch`` is JumpReLU; ``k`` is a TopK SAE's own ``k`` (0 otherwise); ``top`` the columns
    of ``ids`` and ``values`` this SAE fills (the rest stay at activation 0: inactive).
    """
    if recording(hidden):
        on, width = 1, int(watch.shape[1])
    else:
        on, width = (int(v) for v in flags.tolist())
    n = min(int(hidden.shape[0]), int(ids.shape[0]))
    if not on or n == 0:
        return
    stream = hidden[:n] if residual is None else hidden[:n] + residual[:n]
    pre = pre_activations(stream, W_enc, b_enc, b_dec)
    index = watch[:n, :width].clamp(0, int(W_enc.shape[1]) - 1) if width else None
    if arch == TOPK:  # the active features are exactly the top k of pre (through relu): no dense activations
        best, best_ids = torch.topk(pre, k, dim=-1, sorted=True)
        best = best.relu()
        if index is not None:  # a watched id's activation: its value where it is among the active ones
            hit = best_ids.unsqueeze(-1) == index.unsqueeze(1)
            watched[:n, :width].copy_((hit * best.unsqueeze(-1)).sum(dim=1))
        ids[:n, :top].copy_(best_ids[:, :top])
        values[:n, :top].copy_(best[:, :top])
        return
    acts = pre.relu()
    if arch == JUMPRELU:
        acts = acts * (pre > threshold).to(acts.dtype)
    best, best_ids = torch.topk(acts, top, dim=-1, sorted=True)
    ids[:n, :top].copy_(best_ids)
    values[:n, :top].copy_(best)
    if index is not None:
        watched[:n, :width].copy_(acts.gather(1, index))


@features.register_fake
def _features_fake(*args: Any, **kwargs: Any) -> None:  # it only writes its buffers: no output to describe
    return None


class FeatureBuffers:
    """What the host shares with every SAE layer's op: the step's flags and each row's watched ids.

    ``flags`` (host memory): whether the step reads features, and how many watched columns it uses.
    ``watch``: ``[rows, W]`` int64, the ids each row watches (the first ``flags[1]`` columns).
    """

    def __init__(self, rows: int, device: Any) -> None:
        self.flags = torch.zeros(2, dtype=torch.int64)
        self.watch = torch.zeros(rows, MAX_WATCHED_FEATURES, dtype=torch.int64, device=device)


class LayerFeatures:
    """One SAE layer's outputs: ``ids`` int32 and ``values`` float32 ``[rows, K]``, ``watched`` ``[rows, W]``."""

    def __init__(self, ids: torch.Tensor, values: torch.Tensor, watched: torch.Tensor) -> None:
        self.ids, self.values, self.watched = ids, values, watched


def install(
    model: Any,
    saes: Sequence[Any],
    rows: int,
    shared: FeatureBuffers,
    width: int,
    weights: Sequence[SaeWeights] | None = None,
) -> list[LayerFeatures]:
    """Give each SAE's layer the in-graph encoder (after whatever that layer computes already).

    ``saes`` are :class:`~prismgate.engines.sae.files.SparseAutoencoder` values; ``width`` is
    the top features every layer keeps (the largest :func:`top_width`; a layer that keeps fewer
    leaves the rest at activation 0, which nobody reports). ``weights``: their tensors on the
    device, when the worker already made them for steering (one copy serves both ops). Returns
    the outputs in ``saes``' order.
    """
    decoder = decoder_layers(model)
    device = next(model.parameters()).device
    if weights is None:
        weights = [SaeWeights(sae, device, decoder=False) for sae in saes]
    out: list[LayerFeatures] = []
    for sae, w in zip(saes, weights, strict=True):
        layer = decoder[sae.layer]
        tensors = {
            "W_enc": w.W_enc,
            "b_enc": w.b_enc,
            "b_dec": w.b_dec,
            "threshold": w.threshold,
            "ids": torch.zeros(rows, width, dtype=torch.int32, device=device),
            "values": torch.zeros(rows, width, dtype=torch.float32, device=device),
            "watched": torch.zeros(rows, MAX_WATCHED_FEATURES, dtype=torch.float32, device=device),
            "watch": shared.watch,
            "flags": shared.flags,
        }
        for name, tensor in tensors.items():  # buffers: compilers treat them as static inputs
            layer.register_buffer(PREFIX + name, tensor, persistent=False)
        top = top_width(sae.architecture, sae.d_sae, sae.k)
        layer.forward = _with_features(layer, layer.forward, w.arch, w.k, top)
        out.append(LayerFeatures(tensors["ids"], tensors["values"], tensors["watched"]))
    return out


_INPUTS = ("W_enc", "b_enc", "b_dec", "threshold")


def _with_features(layer: torch.nn.Module, forward: Any, arch: int, k: int, top: int) -> Any:
    """``top``: the columns of the layer's buffers this SAE fills (the rest stay 0: inactive)."""

    def forward_with_features(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        if isinstance(output, tuple):  # vLLM's decoder layers return (hidden_states, residual)
            hidden, residual = output[0], (output[1] if len(output) > 1 else None)
        else:
            hidden, residual = output, None
        torch.ops.prismgate.features(
            hidden,
            residual,
            *(getattr(layer, PREFIX + name) for name in _INPUTS),
            getattr(layer, PREFIX + "ids"),
            getattr(layer, PREFIX + "values"),
            getattr(layer, PREFIX + "watch"),
            getattr(layer, PREFIX + "watched"),
            getattr(layer, PREFIX + "flags"),
            arch,
            k,
            top,
        )
        return output

    return forward_with_features
