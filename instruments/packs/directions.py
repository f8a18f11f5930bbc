"""Difference-of-means directions: one unit vector per concept and layer, and the words that describe them.

A concept's direction at layer L is the normalised difference of its positive and negative
prompts' mean residual streams (float64, then float32 normalised again); its center the midpoint
of the two classes' mean readout on that direction, the threshold the separation report scores
tokens against. The formulas and why each concept needs its own center: docs/instruments.md,
"Directions, centers and scales".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from prismgate.core.errors import invalid
from prismgate.instruments.packs.capture import Capture, CapturedPrompts
from prismgate.instruments.packs.prompt_sets import PromptSet, prompt_sets_digest


def direction(pos: npt.NDArray[np.float64], neg: npt.NDArray[np.float64], *, what: str = "") -> npt.NDArray[np.float64]:
    """normalize(mean(pos) - mean(neg)) over the first axis, in float64."""
    diff = pos.mean(axis=0) - neg.mean(axis=0)
    norm = float(np.linalg.norm(diff))
    if not np.isfinite(norm) or norm == 0.0:
        raise invalid(f"{what or 'concept'}: positive and negative prompts have the same mean; no direction")
    return diff / norm


def concept_directions(
    sets: Sequence[PromptSet], prompts: CapturedPrompts, layers: Sequence[int]
) -> npt.NDArray[np.float32]:
    """``[n_layers, n_concepts, hidden]`` float32 unit rows: each set's direction at each layer."""
    directions = np.stack(
        [
            np.stack([direction(prompts.means(s.positive, L), prompts.means(s.negative, L), what=s.name) for s in sets])
            for L in layers
        ]
    ).astype(np.float32)
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)  # exact unit rows after the cast
    return directions


def concept_centers(
    sets: Sequence[PromptSet], prompts: CapturedPrompts, layers: Sequence[int], directions: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """``[n_layers, n_concepts]`` float32: the midpoint of each set's mean positive and negative readout.

    ``directions`` are the pack's own float32 rows (:func:`concept_directions`), so a center sits
    on the same scale as the readouts the gateway serves; the arithmetic is in float64.
    """
    centers = np.zeros(directions.shape[:2], dtype=np.float64)
    for li, layer in enumerate(layers):
        for ci, s in enumerate(sets):
            d = directions[li, ci].astype(np.float64)
            pos = float((prompts.means(s.positive, layer) @ d).mean())
            neg = float((prompts.means(s.negative, layer) @ d).mean())
            centers[li, ci] = 0.5 * (pos + neg)
    return centers.astype(np.float32)


def method_text(sets: Sequence[PromptSet], capture: Capture, *, dtype: str, layer_note: str) -> str:
    """The pack's ``method`` metadata: enough to know what a direction means and to rebuild it."""
    skip_first, outlier_factor = capture.skip_first, capture.outlier_factor
    n_pos = sum(len(s.positive) for s in sets)
    n_neg = sum(len(s.negative) for s in sets)
    tokens = f"tokens {skip_first}..n-1 (tokens before {skip_first} left out: attention sink)"
    if outlier_factor:
        tokens += f", less tokens with norm > {outlier_factor:g}x the prompt's median norm (massive activations)"
    parts = [
        "difference of means: direction = normalize(mean over positive prompts - mean over negative prompts) "
        f"of each prompt's mean residual stream after decoder layer L over {tokens}",
        "centers: center = 0.5 * (mean over positive prompts + mean over negative prompts) of each prompt's "
        "mean token readout (prompt mean . float32 direction: every prompt weighs the same), per concept and layer",
        f"raw text prompts (no chat template): {n_pos} positive / {n_neg} negative, "
        f"prompt sets sha256:{prompt_sets_digest(sets)}",
        f"model dtype {dtype}, float64 accumulation, 1 thread, sorted right-padded batches of {capture.batch_size}",
    ]
    if layer_note:
        parts.append(layer_note)
    return "; ".join(parts)
