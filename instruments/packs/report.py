"""The held-out separation report: how well each concept's direction separates prompts it was not built from.

Folds of prompt pairs are held out (k-fold, pair i in fold i mod k); the direction is built on
the rest, and held-out prompts are scored by their mean projection against the midpoint of the
training classes' mean projections: prompt accuracy and Cohen's d per concept and layer. A second
pass projects every counted token on every fold's direction for the token accuracy, which is what a
served readout is. This report is how ``build.DEFAULT_LAYERS`` were chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from prismgate.core.errors import invalid
from prismgate.instruments.packs.capture import Capture, CapturedPrompts, deterministic_torch
from prismgate.instruments.packs.directions import direction
from prismgate.instruments.packs.prompt_sets import PromptSet

DEFAULT_FOLDS = 4


@dataclass(frozen=True)
class Separation:
    """How well one concept's direction at one layer separates held-out prompts and their tokens."""

    concept: str
    layer: int
    accuracy: float  # held-out prompts whose mean projection is on the right side of the training midpoint
    cohens_d: float  # (mean_pos - mean_neg) / pooled std of those held-out prompt projections
    token_accuracy: float  # held-out tokens (those the means count) on the right side of the same midpoint
    prompts: int  # held-out prompts scored over all folds (every prompt once)
    tokens: int  # held-out tokens scored


@dataclass(frozen=True)
class SeparationReport:
    folds: int
    rows: tuple[Separation, ...]
    excluded: dict[int, float] = field(default_factory=dict)  # layer -> fraction of tokens left out as outliers

    @property
    def concepts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.concept for r in self.rows))

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({r.layer for r in self.rows}))

    def get(self, concept: str, layer: int) -> Separation:
        for r in self.rows:
            if r.concept == concept and r.layer == layer:
                return r
        raise KeyError((concept, layer))

    def table(self) -> str:
        """Concepts down, layers across; one block per measure."""
        concepts, layers = self.concepts, self.layers
        width = max(12, *(len(c) for c in concepts))
        head = " " * width + "".join(f"{'L' + str(layer):>6}" for layer in layers)
        lines = [f"held-out separation, {self.folds}-fold over prompt pairs"]
        for title, attr, fmt in (
            ("prompt accuracy (mean projection of each held-out prompt)", "accuracy", "{:>6.2f}"),
            ("Cohen's d of held-out prompt projections", "cohens_d", "{:>6.1f}"),
            ("token accuracy (each held-out token's readout)", "token_accuracy", "{:>6.2f}"),
        ):
            lines += ["", title, head]
            for c in concepts:
                lines.append(f"{c:<{width}}" + "".join(fmt.format(getattr(self.get(c, x), attr)) for x in layers))
            means = [float(np.mean([getattr(self.get(c, x), attr) for c in concepts])) for x in layers]
            lines.append(f"{'mean':<{width}}" + "".join(fmt.format(m) for m in means))
        if self.excluded:
            lines += ["", f"{'outliers':<{width}}" + "".join(f"{self.excluded.get(x, 0.0):>6.1%}" for x in layers)]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "folds": self.folds,
            "excluded": {str(k): v for k, v in sorted(self.excluded.items())},
            "rows": [
                {
                    "concept": r.concept,
                    "layer": r.layer,
                    "accuracy": r.accuracy,
                    "cohens_d": r.cohens_d,
                    "token_accuracy": r.token_accuracy,
                    "prompts": r.prompts,
                    "tokens": r.tokens,
                }
                for r in self.rows
            ],
        }


@dataclass(frozen=True)
class FoldFit:
    """A direction fitted without one fold, and the prompts of that fold (indices into each side)."""

    direction: npt.NDArray[np.float64]
    mid: float  # midpoint of the training classes' mean projections: the decision threshold
    heldout_pos: npt.NDArray[np.intp]
    heldout_neg: npt.NDArray[np.intp]


def fit_folds(name: str, pos: npt.NDArray[np.float64], neg: npt.NDArray[np.float64], folds: int) -> list[FoldFit]:
    """k-fold fits of one concept at one layer; prompt i of either side is in fold ``i % k``.

    Pairs share an index, so a topic never sits on both sides of a split.
    """
    folds = min(folds, len(pos), len(neg))
    if folds < 2:
        raise invalid(f"prompt set {name!r}: a separation report needs at least 2 prompts on each side")
    fold_pos, fold_neg = np.arange(len(pos)) % folds, np.arange(len(neg)) % folds
    fits = []
    for k in range(folds):
        tp, tn = pos[fold_pos != k], neg[fold_neg != k]
        d = direction(tp, tn, what=name)
        mid = 0.5 * (float((tp @ d).mean()) + float((tn @ d).mean()))
        fits.append(FoldFit(d, mid, np.flatnonzero(fold_pos == k), np.flatnonzero(fold_neg == k)))
    return fits


def _cohens_d(pos: npt.NDArray[np.float64], neg: npt.NDArray[np.float64]) -> float:
    n_p, n_n = len(pos), len(neg)
    pooled = ((n_p - 1) * pos.var(ddof=1) + (n_n - 1) * neg.var(ddof=1)) / max(n_p + n_n - 2, 1)
    spread = float(np.sqrt(pooled))
    return float((pos.mean() - neg.mean()) / spread) if spread > 0 else float("inf")


def separation(
    name: str,
    layer: int,
    pos: npt.NDArray[np.float64],
    neg: npt.NDArray[np.float64],
    fits: Sequence[FoldFit],
    pos_tokens: Sequence[Sequence[npt.NDArray[np.float64]]] | None = None,
    neg_tokens: Sequence[Sequence[npt.NDArray[np.float64]]] | None = None,
) -> Separation:
    """Score held-out prompts (``pos``/``neg``: ``[n, hidden]`` prompt means) against their fold's fit.

    ``pos_tokens[k][i]``, if given, are the token projections of positive prompt i on fold k's
    direction (likewise ``neg_tokens``): they give the token accuracy.
    """
    sp = np.concatenate([pos[f.heldout_pos] @ f.direction - f.mid for f in fits])
    sn = np.concatenate([neg[f.heldout_neg] @ f.direction - f.mid for f in fits])
    right = tokens = 0
    if pos_tokens is not None and neg_tokens is not None:
        for k, f in enumerate(fits):
            for i in f.heldout_pos:
                t = pos_tokens[k][i] - f.mid
                right, tokens = right + int((t > 0).sum()), tokens + len(t)
            for i in f.heldout_neg:
                t = neg_tokens[k][i] - f.mid
                right, tokens = right + int((t < 0).sum()), tokens + len(t)
    accuracy = (int((sp > 0).sum()) + int((sn < 0).sum())) / (len(sp) + len(sn))
    return Separation(
        concept=name,
        layer=layer,
        accuracy=accuracy,
        cohens_d=_cohens_d(sp, sn),
        token_accuracy=right / tokens if tokens else float("nan"),
        prompts=len(sp) + len(sn),
        tokens=tokens,
    )


def separation_report(
    model: Any,
    sets: Sequence[PromptSet],
    prompts: CapturedPrompts,
    capture: Capture,
    layers: tuple[int, ...],
    *,
    folds: int = DEFAULT_FOLDS,
    threads: int = 1,
) -> SeparationReport:
    """The report at ``layers`` (all captured in ``prompts``), with one more pass of ``capture`` for token accuracy."""
    fits = {
        (st.name, L): fit_folds(st.name, prompts.means(st.positive, L), prompts.means(st.negative, L), folds)
        for st in sets
        for L in layers
    }
    # One more pass: every token's projection on every fold's direction, for token accuracy.
    columns = {
        (st.name, k): c
        for c, (st, k) in enumerate((st, k) for st in sets for k in range(len(fits[(st.name, layers[0])])))
    }
    matrices = np.stack([np.stack([fits[(name, L)][k].direction for (name, k) in columns], axis=1) for L in layers])
    with deterministic_torch(threads):
        projections = capture.token_projections(model, prompts.token_ids, layers, matrices)

    def token_scores(texts: Sequence[str], name: str, j: int) -> list[list[npt.NDArray[np.float64]]]:
        n_folds = len(fits[(name, layers[0])])
        return [[projections[prompts.rows[p]][j][:, columns[(name, k)]] for p in texts] for k in range(n_folds)]

    collected = prompts.collected
    total = max(int(collected.tokens.sum()), 1)
    return SeparationReport(
        folds=folds,
        excluded={L: float(collected.excluded[:, prompts.slots[L]].sum()) / total for L in layers},
        rows=tuple(
            separation(
                st.name,
                L,
                prompts.means(st.positive, L),
                prompts.means(st.negative, L),
                fits[(st.name, L)],
                token_scores(st.positive, st.name, j),
                token_scores(st.negative, st.name, j),
            )
            for st in sets
            for j, L in enumerate(layers)
        ),
    )
