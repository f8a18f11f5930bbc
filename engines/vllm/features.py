"""One position's SAE features as the gateway keeps them, and as a token event carries them.

The worker sends, per position, the top ``k`` features of every SAE layer (largest first) and
the activations of the ids the request watches (:mod:`.sae_op`, :mod:`.channel`). A
:class:`FeatureRow` holds that for one position, with the ids it watched, so the session
store (:mod:`.store`) can tell whether it answers a later request (enough top features, the
ids it watches among those watched then). :func:`event_features` cuts a row down to what a
request asked for, exactly as the transformers engine does
(:meth:`prismgate.engines.sae.probe.Captured.features`): its layers in its order, its ``top_k``,
inactive features (activation 0) left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from prismgate.core.features import MAX_FEATURE_TOP_K, FeatureManifest, Features, FeatureSpec
from prismgate.engines.sae.files import SparseAutoencoder


@dataclass(frozen=True)
class FeatureRow:
    """One position's features at every SAE layer: ``ids``/``values`` ``[layers, k]``, ``watched`` ``[layers, w]``."""

    ids: npt.NDArray[np.int32]
    values: npt.NDArray[np.float32]
    watch: tuple[int, ...] = ()  # the ids ``watched``'s columns hold
    watched: npt.NDArray[np.float32] | None = None

    def serves(self, spec: FeatureSpec, top: int) -> bool:
        """Whether this row answers ``spec``; ``top`` is the most features the worker keeps per layer."""
        return int(self.ids.shape[1]) >= min(spec.top_k, top) and set(spec.ids) <= set(self.watch)


def event_features(row: FeatureRow, spec: FeatureSpec, manifest: FeatureManifest) -> Features:
    """The features ``spec`` asks for, from one position's row."""
    ids, values, watched = [], [], []
    column = {f: i for i, f in enumerate(row.watch)}
    for layer in spec.layers:
        i = manifest.layers.index(layer)
        v = row.values[i, : spec.top_k]
        keep = v > 0
        ids.append(row.ids[i, : spec.top_k][keep].astype(np.int64))
        values.append(v[keep].astype(np.float32))
        if spec.ids:
            assert row.watched is not None
            watched.append(row.watched[i, [column[f] for f in spec.ids]])
    return Features(
        layers=spec.layers,
        ids=ids,
        values=values,
        watched=np.stack(watched).astype(np.float32) if spec.ids else None,
    )


def manifest(saes: Sequence[SparseAutoencoder]) -> FeatureManifest | None:
    """What the engine tells the core about its SAEs (None without any), as the transformers engine does."""
    if not saes:
        return None
    return FeatureManifest(
        layers=tuple(s.layer for s in saes),
        widths=tuple(s.d_sae for s in saes),
        labels=tuple(s.labels for s in saes),
    )


def top_width(architecture: str, d_sae: int, k: int | None) -> int:
    """How many top features the op keeps per row: the most a request may ask, or fewer when fewer can be active."""
    width = min(MAX_FEATURE_TOP_K, d_sae)
    return min(width, k) if architecture == "topk" and k is not None else width
