"""The SAE encoder's arithmetic as vLLM's in-graph ops compute it: on the device, float32, fixed shapes.

Two ops encode the residual stream: the feature op (:mod:`.sae_op`, the top features and watched
ids a client reads) and the steering op (:mod:`.capture`, the activation a clamp sets and a
feature gate compares). Both take the pre-activations and the activations of chosen features from
here, so what a client reads and what a clamp or a gate acts on are one computation. The
definitions are the transformers engine's (:mod:`prismgate.engines.sae.encode`, checked against
SAELens): ``pre = (x - b_dec) @ W_enc + b_enc``, then ReLU, TopK (the ``k`` largest of ``pre``,
through ReLU) or JumpReLU (ReLU where ``pre > threshold``).

Only torch (and prismgate's row-invariant padding) is imported here: this runs inside vLLM's worker process.
"""

from __future__ import annotations

from typing import Any

import torch

from prismgate.engines.invariant_rows import in_blocks

ARCHITECTURES = {"standard": 0, "topk": 1, "jumprelu": 2}
TOPK = ARCHITECTURES["topk"]
JUMPRELU = ARCHITECTURES["jumprelu"]


class SaeWeights:
    """One SAE's tensors on the device, float32 whatever the file holds, made once per worker.

    ``b_dec`` is zero when the SAE does not subtract it from its input (``x - 0`` is ``x``, bit for
    bit); ``threshold`` is empty unless the SAE is JumpReLU; ``k`` is a TopK SAE's own (0 otherwise).
    ``W_dec`` only when the layer steers (a clamp adds decoder rows, a feature entry's direction is one).
    """

    def __init__(self, sae: Any, device: Any, *, decoder: bool) -> None:
        def put(array: Any) -> torch.Tensor:
            return torch.as_tensor(array, dtype=torch.float32).to(device).contiguous()

        self.sae = sae
        self.layer = int(sae.layer)
        self.arch = ARCHITECTURES[sae.architecture]
        self.k = int(sae.k or 0) if self.arch == TOPK else 0
        self.W_enc, self.b_enc = put(sae.W_enc), put(sae.b_enc)
        self.b_dec = put(sae.b_dec) if sae.apply_b_dec_to_input else torch.zeros(sae.d_in, device=device)
        self.threshold = put(sae.threshold) if sae.threshold is not None else torch.zeros(0, device=device)
        self.W_dec = put(sae.W_dec) if decoder else torch.zeros(0, sae.d_in, device=device)


def pre_activations(
    stream: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor
) -> torch.Tensor:
    """``[rows, d_sae]``: ``(stream - b_dec) @ W_enc + b_enc`` in float32 (the feature op's: one fused product)."""
    return torch.addmm(b_enc, stream.to(torch.float32) - b_dec, W_enc)


def row_pre_activations(
    stream: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, b_dec: torch.Tensor
) -> torch.Tensor:
    """The same, each row's bits those it gets in a product of any number of rows (the steering op's).

    The product runs in blocks of a fixed number of rows (:func:`~prismgate.engines.invariant_rows.in_blocks`),
    the arithmetic of the transformers engine's clamps and feature gates (its encoder under the
    invariant switch), so a clamped row does not depend on how many rows the step encodes beside it.
    """
    return in_blocks(stream.to(torch.float32) - b_dec, lambda rows: rows @ W_enc) + b_enc


def activations_at(pre: torch.Tensor, ids: torch.Tensor, arch: int, k: int, threshold: torch.Tensor) -> torch.Tensor:
    """``[rows, c]``: the activations of features ``ids`` (``[rows, c]``, int64, valid ids) of each row.

    TopK needs the row's whole top ``k``: a feature is active only where it is among them, and then
    its activation is its pre-activation through ReLU (the same test the feature op's watched ids use).
    """
    if arch == TOPK:
        best, best_ids = torch.topk(pre, k, dim=-1, sorted=True)
        hit = best_ids.unsqueeze(-1) == ids.unsqueeze(1)  # [rows, k, c]: at most one hit per column
        return (hit * best.relu().unsqueeze(-1)).sum(dim=1)
    chosen = pre.gather(1, ids)
    acts = chosen.relu()
    if arch == JUMPRELU:
        acts = acts * (chosen > threshold[ids]).to(acts.dtype)
    return acts
