"""SAE features per token: what a request asks for, what an engine offers, what a token carries.

A model served with sparse autoencoders (``sae`` setting, docs/sae.md) has a
:class:`FeatureManifest`: the layers that have one, each SAE's width and its labels. A request
asks with a :class:`FeatureSpec`: at the positions of ``ranges``, the ``top_k`` most active
features at each of ``layers`` (empty: every SAE layer), and the activations of ``ids`` (the
features a client watches) whether active or not. A token then carries :class:`Features`:
per layer the top ids and their activations, largest first, and the watched activations.

Every number a client sends is checked here or in :func:`check_features` before any work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from prismgate.core.actions import PositionRange
from prismgate.core.errors import invalid

MAX_FEATURE_TOP_K = 64  # top features per token and layer a request may ask for
MAX_WATCHED_FEATURES = 256  # feature ids a request may watch


@dataclass(frozen=True, slots=True)
class FeatureManifest:
    """The SAEs of a model: ``layers[i]`` has ``widths[i]`` features, ``labels[i]`` naming some of them."""

    layers: tuple[int, ...]
    widths: tuple[int, ...]
    labels: tuple[Mapping[int, str], ...] = field(default=(), compare=False)
    hidden_size: int = 0  # the residual stream's width (each SAE's d_in)

    def label(self, layer_index: int, feature: int) -> str | None:
        return self.labels[layer_index].get(feature) if self.labels else None


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """Which features to report: see the module docstring. ``ranges`` is set by the core from the turn."""

    top_k: int = 8
    layers: tuple[int, ...] = ()
    ids: tuple[int, ...] = ()
    ranges: tuple[PositionRange, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.top_k <= MAX_FEATURE_TOP_K:
            raise invalid(f"features top_k must be in [0, {MAX_FEATURE_TOP_K}], got {self.top_k}")
        if len(self.ids) > MAX_WATCHED_FEATURES:
            raise invalid(f"features ids: at most {MAX_WATCHED_FEATURES} feature ids, got {len(self.ids)}")
        if any(i < 0 for i in self.ids):
            raise invalid("features ids must be >= 0")
        if len(set(self.layers)) != len(self.layers):
            raise invalid("features layers must not repeat")
        if self.top_k == 0 and not self.ids:
            raise invalid("features: ask for top_k > 0 or some ids")

    @property
    def wanted(self) -> bool:
        return any(r.end > r.start for r in self.ranges)


@dataclass(slots=True)
class Features:
    """One token's features at the layers asked for, in the request's layer order.

    ``ids[l]`` (int64) and ``values[l]`` (float32): the top ``k`` features at layer ``l``,
    largest first, inactive ones (activation 0) left out, so rows may be shorter than ``k``;
    ``watched[l]``: the activations of the request's ``ids`` at layer ``l`` (float32).
    """

    layers: tuple[int, ...]
    ids: list[npt.NDArray[np.int64]]
    values: list[npt.NDArray[np.float32]]
    watched: npt.NDArray[np.float32] | None = None  # [layers, n_ids]


def check_features(manifest: FeatureManifest | None, model_id: str, spec: FeatureSpec) -> tuple[int, ...]:
    """The layers to read (the request's, or every SAE layer); refused: no SAE, unknown layer, id out of range."""
    if manifest is None:
        raise invalid(f"model {model_id!r} has no sparse autoencoder loaded, so it has no features (docs/sae.md)")
    for layer in spec.layers:
        if layer not in manifest.layers:
            raise invalid(
                f"features layer {layer} has no SAE; the model's SAEs read after layers "
                f"{', '.join(map(str, manifest.layers))}"
            )
    layers = spec.layers or manifest.layers
    width = min(manifest.widths[manifest.layers.index(x)] for x in layers)
    bad = [i for i in spec.ids if i >= width]
    if bad:
        raise invalid(f"features ids {bad[:8]} are outside the SAE's features [0, {width})")
    return layers


def steered_feature(manifest: FeatureManifest | None, layer: int, feature: int, where: str) -> None:
    """A feature a steering entry (or its gate) names: an SAE at ``layer``, and ``feature`` inside its width."""
    if manifest is None:
        raise invalid(f"{where}: the model has no sparse autoencoder loaded, so no feature to steer by (docs/sae.md)")
    if layer not in manifest.layers:
        raise invalid(
            f"{where}: layer {layer} has no SAE, so no feature {feature} to steer by; the model's SAEs read after "
            f"layers {', '.join(map(str, manifest.layers))}"
        )
    width = manifest.widths[manifest.layers.index(layer)]
    if not 0 <= feature < width:
        raise invalid(f"{where}: feature {feature} is outside the SAE's features [0, {width}) at layer {layer}")
