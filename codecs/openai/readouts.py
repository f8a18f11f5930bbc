"""The ``"readouts"`` extension: which slice of the readout manifest a request asked for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prismgate.codecs.binary_numbers import BASE64, b64, dtype_name
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
    binary: np.dtype | None = None  # base64 of this dtype instead of JSON numbers
    _whole: tuple[int, int] | None = field(init=False, repr=False, compare=False)
    _index: tuple[np.ndarray, ...] = field(init=False, repr=False, compare=False)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.layers), "concepts": list(self.concepts)}
        if self.binary is not None:  # said only to a client that asked: the text form's bytes stay as they were
            out.update(encoding_format=BASE64, dtype=dtype_name(self.binary))
        return out

    def __post_init__(self) -> None:
        # taken for every token: the index is built once (and skipped when it is everything, in order)
        n_layers, n_concepts = len(self.layer_index), len(self.concept_index)
        whole = self.layer_index == tuple(range(n_layers)) and self.concept_index == tuple(range(n_concepts))
        object.__setattr__(self, "_whole", (n_layers, n_concepts) if whole else None)
        object.__setattr__(self, "_index", np.ix_(self.layer_index, self.concept_index))

    def take(self, readout: np.ndarray) -> np.ndarray:
        """The requested layers and concepts of one position's readout (float32 ``[layers, concepts]``)."""
        if readout.shape == self._whole:
            return readout
        return readout[self._index]

    def values(self, part: np.ndarray) -> list[list[float]] | str:
        """A taken readout as its JSON value: numbers, or the base64 string a client asked for."""
        return values(part) if self.binary is None else b64(part, self.binary)

    def values_json(self, part: np.ndarray) -> str | None:
        """``dumps(self.values(part))``; None for a non-finite value as text (the general path refuses it)."""
        if self.binary is not None:
            return '"' + b64(part, self.binary) + '"'
        return values_json(part)


def values(part: np.ndarray) -> list[list[float]]:
    """A taken readout as JSON numbers: each float32 in its shortest round-trip form, exact and short on the wire."""
    return [[float(s) for s in row] for row in part.astype(str).tolist()]


def values_json(part: np.ndarray) -> str | None:
    """``dumps(values(part))`` without the floats in between: a stream writes this for every token.

    numpy's shortest float32 text is what Python prints for the same number, but for
    numpy's exponent forms (it switches to them at other magnitudes): those are
    re-printed Python's way. One conversion and one look for the rare forms per readout,
    not per row. Non-finite values have no JSON form: for them this returns None and the
    caller keeps to the general path, which refuses them as every payload does (numpy
    prints them ``nan`` and ``inf``, the only forms with an ``n``).
    """
    width = part.shape[1]
    flat = part.astype(str).ravel().tolist()
    text = "[[" + "],[".join([",".join(flat[i : i + width]) for i in range(0, len(flat), width)]) + "]]"
    if "e" in text or "n" in text:
        if "n" in text:
            return None
        flat = [s if "e" not in s else repr(float(s)) for s in flat]
        text = "[[" + "],[".join([",".join(flat[i : i + width]) for i in range(0, len(flat), width)]) + "]]"
    return text


def readout_axes(manifest: ReadoutManifest, wanted: ReadoutRequest) -> ReadoutAxes:
    li = select(manifest.layers, wanted.layers, "layers", "readouts.layers")
    ci = select(manifest.concepts, wanted.concepts, "concepts", "readouts.concepts")
    return ReadoutAxes(
        layers=tuple(manifest.layers[i] for i in li),
        concepts=tuple(manifest.concepts[i] for i in ci),
        layer_index=li,
        concept_index=ci,
        binary=wanted.binary,
    )


def as_readouts_param(exc: GatewayError) -> Exception:
    """A core refusal of readouts (no concept pack), named as the ``readouts`` field."""
    return bad_request(exc.message, "readouts")
