"""Concept packs: a safetensors file of unit directions in the residual stream.

A pack holds, per layer it reads after and per concept, a unit direction (the readout of a
token is ``directions[l] @ h_L(token)``), optionally each concept's neutral center, its scale
and where it steers, and metadata saying the model, the layers and how the vectors were made.
The format, field by field, is docs/architecture.md, "Concept pack files". The file is written
by :func:`_safetensors_bytes`, not safetensors' own writer, so that a pack always gives the
same bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
from safetensors import safe_open
from safetensors.numpy import load_file

from prismgate.core.engine import ReadoutManifest
from prismgate.core.errors import invalid

FORMAT = "prismgate.concept-pack/1"
LAYER_CONVENTION = "residual stream after decoder layer L"
DEFAULT_PACKS = Path(__file__).parent / "packs"
# The layer displays open on: docs/readouts.md reports the default pack's held-out accuracy there.
PREFERRED_VIEW_LAYER = 16


def view_layer(layers: tuple[int, ...]) -> int:
    """Index of the layer a display shows first: :data:`PREFERRED_VIEW_LAYER`, else the middle one."""
    return layers.index(PREFERRED_VIEW_LAYER) if PREFERRED_VIEW_LAYER in layers else len(layers) // 2


@dataclass(frozen=True)
class SteeringRange:
    """Where one concept steers, as measured: a layer of the pack, a starting scale, the fluent reach."""

    layer: int
    scale: float  # the measured rung that moved the concept's readout most while the text stayed fluent
    range: float  # the largest measured scale at ``layer`` that kept the text fluent (>= scale)
    effect: float  # how far ``scale`` moved the concept's readout over the answer, in the pack's scales

    def to_json(self) -> dict[str, float | int]:
        return {"layer": self.layer, "scale": self.scale, "range": self.range, "effect": self.effect}


@dataclass(frozen=True)
class ConceptPack:
    directions: npt.NDArray[np.float32]  # [n_layers, n_concepts, hidden]
    layers: tuple[int, ...]
    concepts: tuple[str, ...]
    model_id: str
    method: str = ""
    descriptions: dict[str, str] = field(default_factory=dict)
    centers: npt.NDArray[np.float32] | None = None  # [n_layers, n_concepts]; see the module docstring
    scales: npt.NDArray[np.float32] | None = None  # [n_layers, n_concepts], > 0; see the module docstring
    steering: dict[str, SteeringRange] | None = None  # concept -> where it steers; see the module docstring

    def __post_init__(self) -> None:
        d = self.directions
        if d.ndim != 3 or d.shape[:2] != (len(self.layers), len(self.concepts)):
            raise invalid(
                f"concept pack directions have shape {d.shape}, expected "
                f"[{len(self.layers)} layers, {len(self.concepts)} concepts, hidden]"
            )
        norms = np.linalg.norm(d, axis=-1)
        if not np.allclose(norms, 1.0, atol=1e-3):
            raise invalid("concept pack directions must be unit vectors")
        c = self.centers
        if c is not None:
            if c.shape != d.shape[:2]:
                raise invalid(
                    f"concept pack centers have shape {c.shape}, expected "
                    f"[{len(self.layers)} layers, {len(self.concepts)} concepts]"
                )
            if not np.all(np.isfinite(c)):
                raise invalid("concept pack centers must be finite numbers")
        s = self.scales
        if s is not None:
            if s.shape != d.shape[:2]:
                raise invalid(
                    f"concept pack scales have shape {s.shape}, expected "
                    f"[{len(self.layers)} layers, {len(self.concepts)} concepts]"
                )
            if not np.all(np.isfinite(s) & (s > 0)):
                raise invalid("concept pack scales must be finite numbers above zero")
        for concept, r in (self.steering or {}).items():
            if concept not in self.concepts or r.layer not in self.layers:
                raise invalid(f"concept pack steering names {concept!r} at layer {r.layer}, not in the pack")
            if not (math.isfinite(r.effect) and 0 < r.scale <= r.range and math.isfinite(r.range)):
                raise invalid(f"concept pack steering for {concept!r} needs 0 < scale <= range, finite")

    @property
    def hidden_size(self) -> int:
        return int(self.directions.shape[2])

    @property
    def manifest(self) -> ReadoutManifest:
        centers = None
        if self.centers is not None:
            centers = tuple(tuple(float(v) for v in row) for row in self.centers.astype(np.float32))
        return ReadoutManifest(
            concepts=self.concepts, layers=self.layers, hidden_size=self.hidden_size, centers=centers
        )

    def check_model(self, n_layers: int, hidden_size: int) -> None:
        if hidden_size != self.hidden_size:
            raise invalid(f"concept pack hidden size {self.hidden_size} does not match the model's {hidden_size}")
        bad = [layer for layer in self.layers if not 0 <= layer < n_layers]
        if bad:
            raise invalid(f"concept pack layers {bad} do not exist in a model of {n_layers} layers")

    def save(self, path: str | Path) -> None:
        """Write the pack; the same pack always gives the same bytes (so rebuilds diff clean)."""
        metadata = {
            "format": FORMAT,
            "model_id": self.model_id,
            "layers": json.dumps(list(self.layers)),
            "concepts": json.dumps(list(self.concepts)),
            "hidden_size": str(self.hidden_size),
            "layer_convention": LAYER_CONVENTION,
            "method": self.method,
            "descriptions": json.dumps(self.descriptions, sort_keys=True),
        }
        if self.steering is not None:
            metadata["steering"] = json.dumps({c: r.to_json() for c, r in self.steering.items()}, sort_keys=True)
        tensors = {"directions": np.ascontiguousarray(self.directions, dtype="<f4")}
        if self.centers is not None:
            tensors["centers"] = np.ascontiguousarray(self.centers, dtype="<f4")
        if self.scales is not None:
            tensors["scales"] = np.ascontiguousarray(self.scales, dtype="<f4")
        Path(path).write_bytes(_safetensors_bytes(tensors, metadata))

    @classmethod
    def load(cls, path: str | Path) -> ConceptPack:
        path = Path(path)
        if not path.exists():
            raise invalid(f"concept pack {path} does not exist")
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise invalid(f"{path} is not a concept pack (format {meta.get('format')!r}, expected {FORMAT!r})")
        if meta.get("layer_convention") != LAYER_CONVENTION:
            raise invalid(f"{path}: unsupported layer convention {meta.get('layer_convention')!r}")
        tensors = load_file(str(path))
        if "directions" not in tensors:
            raise invalid(f"{path}: concept pack has no 'directions' tensor")
        centers, scales = tensors.get("centers"), tensors.get("scales")
        return cls(
            directions=tensors["directions"].astype(np.float32),
            layers=tuple(int(x) for x in json.loads(meta["layers"])),
            concepts=tuple(json.loads(meta["concepts"])),
            model_id=meta.get("model_id", ""),
            method=meta.get("method", ""),
            descriptions=json.loads(meta.get("descriptions", "{}")),
            centers=None if centers is None else centers.astype(np.float32),
            scales=None if scales is None else scales.astype(np.float32),
            steering=_steering(path, meta.get("steering")),
        )


def _steering(path: Path, text: str | None) -> dict[str, SteeringRange] | None:
    """The ``steering`` metadata, or None for a pack built before it existed."""
    if text is None:
        return None
    try:
        raw = json.loads(text)
        return {
            str(c): SteeringRange(int(r["layer"]), float(r["scale"]), float(r["range"]), float(r["effect"]))
            for c, r in raw.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise invalid(f"{path}: the pack's steering metadata is malformed ({exc})") from None


def _safetensors_bytes(tensors: dict[str, npt.NDArray[np.float32]], metadata: dict[str, str]) -> bytes:
    """Float32 tensors in the safetensors layout, byte-for-byte reproducible.

    safetensors' own writer orders metadata differently from run to run; the layout (8-byte
    little-endian header size, JSON header padded to 8 bytes with spaces, then the raw data) is
    simple enough to write directly. Tensors go in name order (``centers``, ``directions``,
    ``scales``): each one's ``data_offsets`` are ``[begin, end)`` relative to the end of the
    header, and their data is concatenated in that same order with no gaps. A pack without
    ``scales`` gives exactly the bytes it gave before scales existed.
    """
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name], dtype="<f4")
        data = array.tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + b"".join(chunks)
