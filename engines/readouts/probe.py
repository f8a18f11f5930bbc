"""Readouts computed inside the forward pass, by hooks on the decoder layers.

The residual stream after layer L is what layer L returns; HF's ``hidden_states``
applies the final norm to the last entry, so hooks are the only exact source for
every layer. The dot products are taken inside the hook, in float32, so nothing
but ``[tokens, n_concepts]`` per layer is kept.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from prismgate.engines.introspect import decoder_layers, hidden_size
from prismgate.engines.invariant_rows import matmul_rows
from prismgate.engines.readouts.pack import ConceptPack


class ReadoutProbe:
    def __init__(self, model: Any, pack: ConceptPack) -> None:
        layers = decoder_layers(model)
        pack.check_model(len(layers), hidden_size(model))
        self.pack = pack
        param = next(model.parameters())
        self._directions = [
            torch.from_numpy(pack.directions[i]).to(device=param.device, dtype=torch.float32).T.contiguous()
            for i in range(len(pack.layers))
        ]  # each [hidden, n_concepts]
        self.enabled = False
        self._captured: list[torch.Tensor | None] = [None] * len(pack.layers)
        self._handles = [layers[layer].register_forward_hook(self._hook(i)) for i, layer in enumerate(pack.layers)]

    def _hook(self, index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if not self.enabled:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[index] = self.project(index, hidden)

        return hook

    def project(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The readouts of ``hidden`` at the pack's ``index``-th layer: ``[batch, tokens, concepts]``, float32.

        The one projection of this engine: steering gates read the stream through it too.
        """
        return matmul_rows(hidden.to(torch.float32), self._directions[index])

    def take(self) -> npt.NDArray[np.float32]:
        """Readouts of the last forward (of one sequence): ``[tokens, n_layers, n_concepts]``."""
        return self.take_batch()[0]

    def take_batch(self) -> npt.NDArray[np.float32]:
        """Readouts of the last forward: ``[batch, tokens, n_layers, n_concepts]``."""
        parts = self._captured
        if any(p is None for p in parts):
            raise RuntimeError("readout hooks did not fire on every configured layer")
        out = torch.stack([p for p in parts if p is not None], dim=2).cpu().numpy()
        self._captured = [None] * len(parts)
        return out.astype(np.float32, copy=False)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
