"""An SAE on the engine's device: encode a residual stream into feature activations, decode back.

SAELens's arithmetic for each architecture (the tests check it against ``sae-lens`` on the same
weights), in float32 whatever the model's dtype: ``pre = (x - b_dec * apply_b_dec_to_input) @
W_enc + b_enc``, then ``relu(pre)`` (standard), the ``k`` largest through ``relu`` (topk), or
``relu(pre)`` above ``threshold`` (jumprelu); ``decode(acts) = acts @ W_dec + b_dec``. Products go
through :func:`~prismgate.engines.invariant_rows.matmul_rows`, so a token's features do not depend
on its batch. :func:`decoder_direction` is what a steering entry naming a feature adds per unit
of ``scale``, on every engine (docs/steering.md).
"""

from __future__ import annotations

import torch

from prismgate.core.steering import unit_vector
from prismgate.engines.invariant_rows import matmul_rows
from prismgate.engines.sae.files import SparseAutoencoder


class SaeEncoder:
    """The weights of one SAE as float32 tensors on ``device``."""

    def __init__(self, sae: SparseAutoencoder, device: torch.device | str = "cpu") -> None:
        self.sae = sae
        self.layer = sae.layer

        def put(array: object) -> torch.Tensor:
            return torch.as_tensor(array, dtype=torch.float32).to(device).contiguous()

        self.W_enc, self.b_enc = put(sae.W_enc), put(sae.b_enc)
        self.W_dec, self.b_dec = put(sae.W_dec), put(sae.b_dec)
        self.threshold = None if sae.threshold is None else put(sae.threshold)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., d_sae]`` before the activation function."""
        x = x.to(torch.float32)
        if self.sae.apply_b_dec_to_input:
            x = x - self.b_dec
        return matmul_rows(x, self.W_enc) + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]`` (dense, mostly zeros) of residual stream ``x [..., d_in]``."""
        pre = self.pre_activations(x)
        arch = self.sae.architecture
        if arch == "topk":
            assert self.sae.k is not None
            values, ids = torch.topk(pre, self.sae.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, ids, values.relu())
        acts = pre.relu()
        if arch == "jumprelu":
            assert self.threshold is not None
            acts = acts * (pre > self.threshold).to(acts.dtype)
        return acts

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``[..., d_in]`` of feature activations ``[..., d_sae]``."""
        return matmul_rows(acts, self.W_dec) + self.b_dec

    def top(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most active features of each row of ``x``: ids (int64) and activations, largest first.

        Inactive features (activation 0) may fill the tail when fewer than ``k`` fire; a caller
        drops them by value.
        """
        acts = self.encode(x)
        values, ids = torch.topk(acts, min(k, acts.shape[-1]), dim=-1, sorted=True)
        return ids, values


def decoder_direction(W_dec: torch.Tensor, feature: int) -> torch.Tensor:
    """``W_dec[feature]`` at unit length, float32 on ``W_dec``'s device: a feature entry's direction.

    Normalised by :func:`~prismgate.core.steering.unit_vector`, as a raw direction is, so a feature
    and its decoder row sent as a ``direction`` add the same bits. The one statement of the rule:
    the transformers engine's hooks and the vLLM worker's vector table both take it from here.
    """
    row = W_dec[feature].to(torch.float32)
    return torch.tensor(unit_vector(row.tolist()), dtype=torch.float32, device=W_dec.device)
