"""The readout table both CLIs print: ``prismgate generate --readouts`` and ``prismgate concepts show --text``.

One row per token: position, token text, logprob, then the chosen concepts at the chosen layers,
each **minus the concept's center** when the pack has centers (above zero leans to the concept's
positive side). Both commands default to the same layer (:func:`~.pack.view_layer`) and take the
same ``--layers`` and ``--concepts``, so the two views of one text agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from prismgate.core.engine import ReadoutManifest
from prismgate.core.errors import invalid
from prismgate.core.events import Readout
from prismgate.engines.readouts.pack import view_layer

TOKEN_WIDTH = 16


@dataclass(frozen=True)
class Columns:
    """Which readout cells the table shows: (manifest layer index, concept index) pairs, in order."""

    layers: tuple[int, ...]  # indices into manifest.layers
    concepts: tuple[int, ...]  # indices into manifest.concepts

    @classmethod
    def choose(cls, manifest: ReadoutManifest, layers: str | None, concepts: str | None) -> Columns:
        return cls(_pick_layers(manifest, layers), _pick_concepts(manifest, concepts))


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _pick_layers(manifest: ReadoutManifest, wanted: str | None) -> tuple[int, ...]:
    if wanted is None:
        return (view_layer(manifest.layers),)
    if wanted.strip() == "all":
        return tuple(range(len(manifest.layers)))
    picked = []
    for name in _names(wanted):
        if not name.isdigit() or int(name) not in manifest.layers:
            raise invalid(f"--layers: no layer {name!r} in the concept pack (it has {list(manifest.layers)})")
        picked.append(manifest.layers.index(int(name)))
    if not picked:
        raise invalid("--layers: give at least one layer")
    return tuple(picked)


def _pick_concepts(manifest: ReadoutManifest, wanted: str | None) -> tuple[int, ...]:
    if wanted is None:
        return tuple(range(len(manifest.concepts)))
    picked = []
    for name in _names(wanted):
        if name not in manifest.concepts:
            known = ", ".join(manifest.concepts)
            raise invalid(f"--concepts: no concept {name!r} in the concept pack (it has {known})")
        picked.append(manifest.concepts.index(name))
    if not picked:
        raise invalid("--concepts: give at least one concept")
    return tuple(picked)


class ReadoutTable:
    """Prints the header once, then one aligned row per token; cells are ``value - center``."""

    def __init__(self, manifest: ReadoutManifest, columns: Columns) -> None:
        self.manifest = manifest
        self.columns = columns
        self.width = max(8, *(len(manifest.concepts[c]) + 1 for c in columns.concepts))

    @property
    def centered(self) -> bool:
        return self.manifest.centers is not None

    def header(self) -> list[str]:
        m, cols = self.manifest, self.columns
        what = "value - center" if self.centered else "raw values (this pack has no centers)"
        lead = f"{'pos':>5} {'token':<{TOKEN_WIDTH}} {'logprob':>8} |"
        group = len(cols.concepts) * self.width
        layers = " ".join(f"{'layer ' + str(m.layers[li]):^{group}}" for li in cols.layers)
        names = " ".join("".join(f"{m.concepts[c]:>{self.width}}" for c in cols.concepts) for _ in cols.layers)
        return [f"readouts, {what}:", f"{'':{len(lead)}}{layers}".rstrip(), f"{lead}{names}"]

    def row(self, position: int, token: str, logprob: float | None, readout: Readout) -> str:
        m, cols = self.manifest, self.columns
        groups = []
        for li in cols.layers:
            cells = []
            for c in cols.concepts:
                value = float(readout[li][c])
                if m.centers is not None:
                    value -= m.centers[li][c]
                cells.append(f"{value:>+{self.width}.2f}")
            groups.append("".join(cells))
        lp = f"{logprob:>8.3f}" if logprob is not None else " " * 8
        text = repr(token)
        text = text if len(text) <= TOKEN_WIDTH else text[: TOKEN_WIDTH - 1] + "…"
        return f"{position:>5} {text:<{TOKEN_WIDTH}} {lp} |" + " ".join(groups)
