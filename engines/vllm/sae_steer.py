"""Steering by SAE feature inside the steering op: clamps, and the activations feature gates compare.

At a layer an SAE reads after, the steering op (:mod:`.capture`) gets the SAE's tensors and the
host-written buffers of :class:`SaeSteerBuffers`: per row and round a feature to clamp and its
target (the vector becomes ``(target - a) * W_dec[f]``), per row the features gates read here,
and the rows that need the encoder at all. The rules, and what CUDA-graph capture records, are
docs/vllm.md, "SAE features in the graph".

Only torch is imported here: this runs inside vLLM's worker process.
"""

from __future__ import annotations

import torch

from prismgate.engines.vllm.encoder import SaeWeights, activations_at, row_pre_activations
from prismgate.engines.vllm.steer import FEATURE_GATES

NO_FEATURE = -1
PREFIX = "prismgate_steer_sae_"  # the buffers' names on the layer
_INPUTS = ("W_enc", "b_enc", "b_dec", "threshold", "W_dec", "clamp_feature", "clamp_target", "gate_feature", "encode")


class SaeSteerBuffers:
    """One SAE layer's feature-steering inputs: what the host writes before a step, beside its SAE's tensors.

    ``clamp_feature`` (int64, -1 none) and ``clamp_target`` (float32) are ``[rows, width]`` like
    the layer's other round buffers; ``gate_feature`` is ``[rows, FEATURE_GATES]`` (int64, -1 none);
    ``encode`` ``[rows]`` (int64) the rows to encode, the first ``m`` of them.
    """

    def __init__(self, layer: torch.nn.Module, weights: SaeWeights, rows: int, width: int) -> None:
        device = weights.W_enc.device
        self.weights = weights
        self.clamp_feature = torch.full((rows, width), NO_FEATURE, dtype=torch.int64, device=device)
        self.clamp_target = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.gate_feature = torch.full((rows, FEATURE_GATES), NO_FEATURE, dtype=torch.int64, device=device)
        self.encode = torch.zeros(rows, dtype=torch.int64, device=device)
        parts = {
            "W_enc": weights.W_enc,
            "b_enc": weights.b_enc,
            "b_dec": weights.b_dec,
            "threshold": weights.threshold,
            "W_dec": weights.W_dec,
            "clamp_feature": self.clamp_feature,
            "clamp_target": self.clamp_target,
            "gate_feature": self.gate_feature,
            "encode": self.encode,
        }
        for name, tensor in parts.items():  # buffers: compilers treat them as static inputs
            layer.register_buffer(PREFIX + name, tensor, persistent=False)

    @staticmethod
    def inputs(layer: torch.nn.Module) -> list[torch.Tensor]:
        """What the op takes as its ``sae`` list, read from the layer (empty: the layer has no SAE)."""
        if not hasattr(layer, PREFIX + _INPUTS[0]):
            return []
        return [getattr(layer, PREFIX + name) for name in _INPUTS]


class FeatureSteer:
    """The op's view of one step at an SAE layer: which rows it encodes, and the clamp and gate arithmetic."""

    def __init__(self, sae: list[torch.Tensor], arch: int, k: int, n: int, m: int | None) -> None:
        """``m``: how many of ``encode``'s rows to encode; None (CUDA-graph capture): all ``n`` rows."""
        (self.W_enc, self.b_enc, self.b_dec, self.threshold, self.W_dec) = sae[:5]
        self.clamp_feature, self.clamp_target, self.gate_feature, encode = sae[5:]
        self.arch, self.k, self.n = arch, k, n
        self.rows = None if m is None else encode[:m]  # None: every row, in order

    def _take(self, x: torch.Tensor) -> torch.Tensor:
        return x[: self.n] if self.rows is None else x[: self.n].index_select(0, self.rows)

    def _put(self, whole: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
        """``whole`` (``[n, ...]``) with the encoded rows replaced by ``part``."""
        return part if self.rows is None else whole.index_copy(0, self.rows, part)

    def pre(self, stream: torch.Tensor) -> torch.Tensor:
        """The encoded rows' pre-activations ``[m, d_sae]`` in ``stream`` (``[n, hidden]``)."""
        return row_pre_activations(self._take(stream), self.W_enc, self.b_enc, self.b_dec)

    def read_gates(self, pre: torch.Tensor, out: torch.Tensor) -> None:
        """Write the gated features' activations of the encoded rows into ``out`` (``[rows, FEATURE_GATES]``)."""
        ids = self._take(self.gate_feature).clamp(min=0)
        values = activations_at(pre, ids, self.arch, self.k, self.threshold)
        if self.rows is None:
            out[: self.n].copy_(values)
        else:
            out.index_copy_(0, self.rows, values)

    def clamp(
        self, pre: torch.Tensor, k: int, add: torch.Tensor, on: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Round ``k``: each clamping row's vector becomes ``(target - activation) * W_dec[f]``; ``on``
        grows by the clamping rows whose activation is not already the target. ``add`` is ``[n, hidden]``,
        ``on`` ``[n]``; ``pre`` the encoded rows' pre-activations in the stream this round starts from."""
        features = self._take(self.clamp_feature[:, k])
        clamped = features >= 0
        ids = features.clamp(min=0)
        activation = activations_at(pre, ids.unsqueeze(-1), self.arch, self.k, self.threshold)  # [m, 1]
        delta = self._take(self.clamp_target[:, k]).unsqueeze(-1) - activation
        vector = torch.where(clamped.unsqueeze(-1), delta * self.W_dec.index_select(0, ids), self._take(add))
        moves = clamped & (delta[:, 0] != 0)
        return self._put(add, vector), on | self._put(torch.zeros_like(on), moves)


def feature_steer(sae: list[torch.Tensor], arch: int, k: int, n: int, m: int | None) -> FeatureSteer | None:
    """The step's :class:`FeatureSteer` at a layer with an SAE (``sae`` non-empty), else None."""
    return FeatureSteer(sae, arch, k, n, m) if sae else None
