"""The ``"readouts"`` extension: which slice of the readout manifest a request asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from prismgate.codecs.openai.errors import bad_request
from prismgate.codecs.openai.request import ReadoutRequest, select
from prismgate.core.engine import ReadoutManifest
from prismgate.core.errors import GatewayError


@dataclass(frozen=True, slots=True)
class ReadoutAxes:
    """The requested slice of the readout manifest: model layer numbers and concept names."""

    layers: tuple[int, ...]
    concepts: tuple[str, ...]
    layer_index: tuple[int, ...]
    concept_index: tuple[int, ...]

    def describe(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "concepts": list(self.concepts)}

    def take(self, readout: np.ndarray) -> list[list[float]]:
        part = readout[np.ix_(self.layer_index, self.concept_index)]
        # str() of a float32 is its shortest round-trip form: exact, and short on the wire
        return [[float(str(v)) for v in row] for row in part]


def readout_axes(manifest: ReadoutManifest, wanted: ReadoutRequest) -> ReadoutAxes:
    li = select(manifest.layers, wanted.layers, "layers", "readouts.layers")
    ci = select(manifest.concepts, wanted.concepts, "concepts", "readouts.concepts")
    return ReadoutAxes(
        layers=tuple(manifest.layers[i] for i in li),
        concepts=tuple(manifest.concepts[i] for i in ci),
        layer_index=li,
        concept_index=ci,
    )


def as_readouts_param(exc: GatewayError) -> Exception:
    """A core refusal of readouts (no concept pack), named as the ``readouts`` field."""
    return bad_request(exc.message, "readouts")
