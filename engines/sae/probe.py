"""SAE features computed inside the forward pass, by hooks on the decoder layers that have an SAE.

Like the readout probe (:mod:`prismgate.engines.readouts.probe`), a forward hook on decoder
layer L sees the residual stream after it, encodes it there (float32, on the model's device)
and keeps only what the requests of this pass asked for: the top ``k`` feature ids and their
activations (``k`` the largest any row asked) and the activations of the watched ids (their
union). The ``[tokens, d_sae]`` activations never leave the hook; one pass serves every row of
a batch, and each row then takes its own ``k``, layers and ids (:meth:`Captured.features`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from prismgate.core.features import FeatureManifest, Features, FeatureSpec
from prismgate.engines.introspect import decoder_layers
from prismgate.engines.sae.encode import SaeEncoder


def feature_manifest(encoders: Sequence[SaeEncoder]) -> FeatureManifest | None:
    """What the engine tells the core about its SAEs (None without any)."""
    if not encoders:
        return None
    return FeatureManifest(
        layers=tuple(e.layer for e in encoders),
        widths=tuple(e.sae.d_sae for e in encoders),
        labels=tuple(e.sae.labels for e in encoders),
        hidden_size=encoders[0].sae.d_in,
        labels_from=tuple(e.sae.labels_from for e in encoders),
    )


# A decode step's few rows are encoded on one thread: their product is small, and on a busy
# machine OpenMP's barrier waits for a descheduled thread far longer than the product takes.
# Prefills keep every thread.
ONE_THREAD_ROWS = 64


@contextlib.contextmanager
def few_threads(rows: int, device: torch.device) -> Iterator[None]:
    """Run what follows on one intra-op thread when ``rows`` is small and the device is the CPU (this thread only)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or rows > ONE_THREAD_ROWS or threads == 1:
        yield
        return
    torch.set_num_threads(1)  # OpenMP's thread count is per calling thread: other model threads keep theirs
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_Reduced = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # top ids, their values, watched activations


class Captured:
    """One forward pass's features: per SAE layer, top ids and values ``[batch, tokens, k]``, watched ``[.., w]``."""

    def __init__(
        self, layers: tuple[int, ...], parts: list[tuple[Any, Any, Any]], watched: list[int], rows: list[int]
    ) -> None:
        self.layers = layers
        self.parts = parts  # numpy, per SAE layer, of the rows that asked
        self.column = {f: i for i, f in enumerate(watched)}
        self.row = {r: i for i, r in enumerate(rows)}  # the pass's row -> its index in parts

    def features(self, row: int, token: int, spec: FeatureSpec) -> Features:
        ids, values, watched = [], [], []
        row = self.row[row]
        for layer in spec.layers:
            top_ids, top_values, seen = self.parts[self.layers.index(layer)]
            v = top_values[row, token, : spec.top_k]
            keep = v > 0
            ids.append(top_ids[row, token, : spec.top_k][keep].astype(np.int64))
            values.append(v[keep].astype(np.float32))
            if spec.ids:
                watched.append(seen[row, token, [self.column[f] for f in spec.ids]])
        return Features(
            layers=spec.layers,
            ids=ids,
            values=values,
            watched=np.stack(watched).astype(np.float32) if spec.ids else None,
        )


class FeatureProbe:
    def __init__(self, model: Any, encoders: Sequence[SaeEncoder]) -> None:
        self.encoders = tuple(encoders)
        self.layers = tuple(e.layer for e in encoders)
        self._k = 0
        self._watched: list[int] = []
        self._watch_index: torch.Tensor | None = None
        self._rows: list[int] = []  # the rows of the pass that asked for features
        self._row_index: torch.Tensor | None = None  # the same, when some rows did not ask
        self._captured: list[_Reduced | None] = [None] * len(encoders)
        blocks = decoder_layers(model)
        self._handles = [blocks[e.layer].register_forward_hook(self._hook(i)) for i, e in enumerate(encoders)]

    def arm(self, specs: Sequence[FeatureSpec | None]) -> bool:
        """Set up the next pass for the rows' specs (None: that row asks nothing); whether anything is asked."""
        asked = [s for s in specs if s is not None]
        self._k = max((s.top_k for s in asked), default=0)
        self._watched = sorted({f for s in asked for f in s.ids})
        device = self.encoders[0].W_enc.device if self.encoders else "cpu"
        self._watch_index = torch.tensor(self._watched, dtype=torch.long, device=device) if self._watched else None
        self._rows = [r for r, s in enumerate(specs) if s is not None]
        partial = len(self._rows) < len(specs)  # rows that ask nothing are not encoded
        self._row_index = torch.tensor(self._rows, dtype=torch.long, device=device) if partial else None
        self._captured = [None] * len(self.encoders)
        return bool(asked)

    def disarm(self) -> None:
        self._k, self._watched, self._watch_index, self._row_index = 0, [], None, None

    @property
    def armed(self) -> bool:
        return self._k > 0 or self._watch_index is not None

    def _hook(self, index: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if not self.armed:
                return
            hidden = output[0] if isinstance(output, tuple) else output
            if self._row_index is not None:
                hidden = hidden.index_select(0, self._row_index.to(hidden.device))
            with few_threads(hidden.numel() // hidden.shape[-1], hidden.device):
                self._captured[index] = self._reduce(self.encoders[index], hidden)

        return hook

    def _reduce(
        self, encoder: SaeEncoder, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Top ids and values (largest first) and the watched activations of ``hidden``'s rows.

        A TopK SAE's active features are the top ``k`` of its pre-activations (through relu), so
        its top features come from one top-k of ``pre`` and the dense activations are never built.
        """
        sae = encoder.sae
        if sae.architecture == "topk" and sae.k is not None:
            values, ids = torch.topk(encoder.pre_activations(hidden), sae.k, dim=-1, sorted=True)
            values = values.relu()
            k = min(max(self._k, 1), sae.k)
            watched = None
            if self._watch_index is not None:  # an id's activation: its value where it is among the active ones
                hit = ids.unsqueeze(-1) == self._watch_index
                watched = (hit * values.unsqueeze(-1)).sum(dim=-2)
            return ids[..., :k], values[..., :k], watched
        acts = encoder.encode(hidden)
        values, ids = torch.topk(acts, min(max(self._k, 1), acts.shape[-1]), dim=-1, sorted=True)
        watched = acts.index_select(-1, self._watch_index) if self._watch_index is not None else None
        return ids, values, watched

    def take(self) -> Captured:
        """The features of the last pass (every armed layer's hook must have fired)."""
        parts = []
        for item in self._captured:
            if item is None:
                raise RuntimeError("SAE hooks did not fire on every SAE layer")
            ids, values, watched = item
            parts.append((ids.cpu().numpy(), values.cpu().numpy(), None if watched is None else watched.cpu().numpy()))
        out = Captured(self.layers, parts, self._watched, self._rows)
        self._captured = [None] * len(self.encoders)
        self.disarm()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
