"""The host half of steering by SAE feature: which rows clamp which feature in which round, which
rows a feature gate reads, and which rows the SAE encodes (:mod:`.sae_steer` is the device half).

:class:`.steer_rows.SteerWriter` fills one :class:`FeaturePlan` per step from the requests'
entries and writes it to each SAE layer's buffers with the rest. Only the rows of requests that
clamp at a layer, or gate on a feature read there, are named for encoding; a step where nobody
does writes a zero count and the op encodes nothing. Stale clamps are cleared when a step no
longer has them, since a replayed CUDA graph reads the clamp buffers whatever the host flags say.

Only torch and numpy are imported here: this runs inside vLLM's worker process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from prismgate.engines.vllm.sae_steer import NO_FEATURE
from prismgate.engines.vllm.steer import FEATURE_GATES

if TYPE_CHECKING:
    from prismgate.engines.vllm.capture import SteerBuffers


class FeaturePlan:
    """One step's clamps, feature-gate reads and rows to encode, per steering layer of this worker."""

    def __init__(self, n_layers: int, n_rows: int, width: int, n_concepts: int) -> None:
        self.n_rows = n_rows
        self.width = width
        self.n_concepts = n_concepts  # gate columns below this are readouts, above it feature activations
        self.mask = [0] * n_layers  # the rounds that clamp at each layer, as bits
        self.clamps: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> features, targets [n_rows, width]
        self.gate_feature: dict[int, np.ndarray] = {}  # layer -> [n_rows, FEATURE_GATES]: the features read there
        self.encode: dict[int, np.ndarray] = {}  # layer -> [n_rows] bool: the rows its SAE encodes

    def _encode(self, layer: int) -> np.ndarray:
        if layer not in self.encode:
            self.encode[layer] = np.zeros(self.n_rows, dtype=np.bool_)
        return self.encode[layer]

    def clamp(self, layer: int, k: int, rows: np.ndarray, feature: int, target: float) -> None:
        """Round ``k`` of ``layer`` sets ``feature``'s activation at ``rows`` to ``target``."""
        if layer not in self.clamps:
            shape = (self.n_rows, self.width)
            self.clamps[layer] = (np.full(shape, NO_FEATURE, dtype=np.int64), np.zeros(shape, dtype=np.float32))
        features, targets = self.clamps[layer]
        features[rows, k] = feature
        targets[rows, k] = target
        self.mask[layer] |= 1 << k
        self._encode(layer)[rows] = True

    def gate(self, layer: int, lo: int, count: int, column: int, feature: int) -> None:
        """A request's rows ``[lo, lo + count)`` have ``layer`` write ``feature``'s activation into gate ``column``."""
        reads = self.gate_feature.get(layer)
        if reads is None:
            reads = self.gate_feature[layer] = np.full((self.n_rows, FEATURE_GATES), NO_FEATURE, dtype=np.int64)
        reads[lo : lo + count, column - self.n_concepts] = feature
        self._encode(layer)[lo : lo + count] = True

    def write(self, layer: int, buffer: SteerBuffers, prior: int) -> int:
        """Write ``layer``'s part into ``buffer``; ``prior`` rows held clamps before. Returns the rows that do now."""
        sae = buffer.sae
        assert sae is not None
        n = self.n_rows
        reads = self.gate_feature.get(layer)
        if reads is not None:
            sae.gate_feature[:n].copy_(torch.from_numpy(reads))
        encode = self.encode.get(layer)
        rows = np.flatnonzero(encode).astype(np.int64) if encode is not None else np.zeros(0, dtype=np.int64)
        if len(rows):
            sae.encode[: len(rows)].copy_(torch.from_numpy(rows))
        buffer.rounds[4] = int(reads is not None)
        buffer.rounds[5] = self.mask[layer]
        buffer.rounds[6] = len(rows)
        if layer in self.clamps:
            features, targets = self.clamps[layer]
            sae.clamp_feature[:n].copy_(torch.from_numpy(features))
            sae.clamp_target[:n].copy_(torch.from_numpy(targets))
            if prior > n:
                sae.clamp_feature[n:prior].fill_(NO_FEATURE)
            return n
        if prior:
            sae.clamp_feature[:prior].fill_(NO_FEATURE)
        return 0
