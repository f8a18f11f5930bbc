"""Generated rows -> output tensors, each only when named (default ``text``).

Rows are padded to the longest completion: ``text`` String [batch]; ``tokens`` Int32
[batch, m] (pad -1); ``lengths`` Int32 [batch]; ``logprobs`` Float32 [batch, m] (pad
NaN); ``top_logprob_ids`` Int32 [batch, m, k] (pad -1) with ``top_logprobs`` Float32
[batch, m, k] (pad NaN), best first; ``readouts`` Float32 [batch, m, n_layers,
n_concepts] (pad NaN), layers as in ``config.readout_layers`` or the concept pack's manifest;
``feature_ids`` Int32 [batch, m, n_layers, k] (pad -1) with ``feature_values`` Float32 (pad NaN),
the top SAE features per token and layer, largest first, and ``watched_features`` Float32
[batch, m, n_layers, n_ids] (pad NaN), as ``config.features`` asks (docs/sae.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from prismgate.codecs.graphpipe.config import Config
from prismgate.codecs.graphpipe.inputs import PAD_ID
from prismgate.codecs.graphpipe.wire import OutTensor
from prismgate.core.actions import MAX_TOP_LOGPROBS
from prismgate.core.engine import ReadoutManifest
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.features import Features, FeatureSpec
from prismgate.schemas.graphpipe.fb.graphpipe_generated import Type

OUTPUTS = ("text", "tokens", "lengths", "logprobs", "top_logprob_ids", "top_logprobs", "readouts")
FEATURE_OUTPUTS = ("feature_ids", "feature_values", "watched_features")  # on a model with an SAE (docs/sae.md)
DEFAULT_OUTPUTS = ("text",)


@dataclass(frozen=True, slots=True)
class Shape:
    """What the answer holds: the outputs in order, the alternatives per token, the readout layers."""

    outputs: list[str]
    top_k: int
    layers: tuple[int, ...] | None  # positions in the manifest's layer list, in output order
    features: FeatureSpec | None = None  # as planned by the core (its layers filled in), when asked


def resolve_outputs(names: Sequence[str], config: Config) -> list[str]:
    outputs = list(names) or list(DEFAULT_OUTPUTS)
    for name in outputs:
        if name not in OUTPUTS and name not in FEATURE_OUTPUTS:
            raise invalid(f"unknown output {name!r}; this server offers {', '.join(OUTPUTS + FEATURE_OUTPUTS)}")
    if {"top_logprob_ids", "top_logprobs"} & set(outputs) and config.logprobs < 1:
        raise invalid(
            f"outputs top_logprob_ids/top_logprobs need config.logprobs = k in [1, {MAX_TOP_LOGPROBS}] "
            "(the alternatives per token)"
        )
    return outputs


def readout_layers(config: Config, manifest: ReadoutManifest) -> tuple[int, ...] | None:
    """Positions of ``config.readout_layers`` in the manifest's layer list (None: all layers)."""
    if config.readout_layers is None:
        return None
    if not config.readout_layers:
        raise invalid("config.readout_layers must name at least one layer")
    if len(set(config.readout_layers)) != len(config.readout_layers):
        raise invalid(f"config.readout_layers {list(config.readout_layers)} repeats a layer")
    missing = [layer for layer in config.readout_layers if layer not in manifest.layers]
    if missing:
        raise invalid(f"config.readout_layers: {missing} not in the concept pack's layers {list(manifest.layers)}")
    return tuple(manifest.layers.index(layer) for layer in config.readout_layers)


@dataclass(slots=True)
class RowResult:
    """What one row generated (decode positions only, in order)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    readouts: list[npt.NDArray[np.float32] | None] = field(default_factory=list)
    features: list[Features | None] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


def _fill(shape: tuple[int, ...], value: float, dtype: str) -> npt.NDArray[Any]:
    return np.full(shape, value, dtype=dtype)


def assemble(shape: Shape, results: Sequence[RowResult], manifest: ReadoutManifest | None) -> list[OutTensor]:
    batch = len(results)
    m = max((len(r.ids) for r in results), default=0)
    built: dict[str, OutTensor] = {}
    for name in dict.fromkeys(shape.outputs):
        if name == "text":
            built[name] = OutTensor.of_strings(["".join(r.text).encode("utf-8") for r in results])
        elif name == "lengths":
            built[name] = OutTensor.of(Type.Int32, [len(r.ids) for r in results])
        elif name == "tokens":
            ids = _fill((batch, m), PAD_ID, "<i4")
            for i, r in enumerate(results):
                ids[i, : len(r.ids)] = r.ids
            built[name] = OutTensor.of(Type.Int32, ids)
        elif name == "logprobs":
            lp = _fill((batch, m), math.nan, "<f4")
            for i, r in enumerate(results):
                lp[i, : len(r.logprobs)] = r.logprobs
            built[name] = OutTensor.of(Type.Float32, lp)
        elif name in ("top_logprob_ids", "top_logprobs"):
            built[name] = _top(shape.top_k, batch, m, results, ids=name == "top_logprob_ids")
        elif name == "readouts":
            assert manifest is not None
            built[name] = _readouts(shape, batch, m, results, manifest)
        elif name in FEATURE_OUTPUTS:
            assert shape.features is not None
            built[name] = _features(name, shape.features, batch, m, results)
        else:  # resolve_outputs admits only known names
            raise GatewayError(Code.INTERNAL, f"output {name!r} has no encoder")
    return [built[name] for name in shape.outputs]


def _top(k: int, batch: int, m: int, results: Sequence[RowResult], *, ids: bool) -> OutTensor:
    out = _fill((batch, m, k), PAD_ID, "<i4") if ids else _fill((batch, m, k), math.nan, "<f4")
    for i, r in enumerate(results):
        for j, alternatives in enumerate(r.top):
            for a, (token, logprob) in enumerate(alternatives[:k]):
                out[i, j, a] = token if ids else logprob
    return OutTensor.of(Type.Int32 if ids else Type.Float32, out)


def _readouts(shape: Shape, batch: int, m: int, results: Sequence[RowResult], manifest: ReadoutManifest) -> OutTensor:
    layers = shape.layers if shape.layers is not None else tuple(range(len(manifest.layers)))
    out = _fill((batch, m, len(layers), len(manifest.concepts)), math.nan, "<f4")
    for i, r in enumerate(results):
        for j, readout in enumerate(r.readouts):
            if readout is not None:
                out[i, j] = np.asarray(readout, dtype=np.float32)[list(layers)]
    return OutTensor.of(Type.Float32, out)


def _features(name: str, spec: FeatureSpec, batch: int, m: int, results: Sequence[RowResult]) -> OutTensor:
    """``feature_ids``, ``feature_values`` or ``watched_features`` [batch, m, n_layers, k or n_ids]."""
    width = len(spec.ids) if name == "watched_features" else spec.top_k
    shape = (batch, m, len(spec.layers), width)
    out = _fill(shape, PAD_ID, "<i4") if name == "feature_ids" else _fill(shape, math.nan, "<f4")
    for i, r in enumerate(results):
        for j, f in enumerate(r.features):
            if f is None:
                continue
            for li in range(len(spec.layers)):
                if name == "watched_features":
                    if f.watched is not None:
                        out[i, j, li] = f.watched[li]
                else:
                    row = f.ids[li] if name == "feature_ids" else f.values[li]
                    out[i, j, li, : len(row)] = row
    return OutTensor.of(Type.Int32 if name == "feature_ids" else Type.Float32, out)
