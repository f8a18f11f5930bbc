"""Build concept packs from contrastive prompt sets, and report how well each direction separates.

A build is four steps, each in its own module: the prompt sets (:mod:`.prompt_sets`), the mean
residual stream of every prompt at each wanted layer (:mod:`.capture`), the directions, centers
(:mod:`.directions`) and scales (:func:`concept_scales`), and optionally the held-out separation
report (:mod:`.report`), which is how :data:`DEFAULT_LAYERS` were chosen. Two builds on one
machine give identical bits. The recipe is docs/instruments.md; the command line is :mod:`.cli`
(:func:`main` here serves ``python -m``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from prismgate.engines.introspect import decoder_layers
from prismgate.engines.readouts.pack import DEFAULT_PACKS, ConceptPack
from prismgate.instruments.packs.capture import (
    DEFAULT_BATCH,
    OUTLIER_FACTOR,
    SKIP_FIRST,
    Capture,
    CapturedPrompts,
    PromptMeans,
    capture_prompts,
    check_layers,
    collect_prompt_means,
    collect_token_projections,
    load_model,
    token_keep,
)
from prismgate.instruments.packs.directions import concept_centers, concept_directions, direction, method_text
from prismgate.instruments.packs.prompt_sets import PromptSet, checked_sets, load_prompt_sets, prompt_sets_digest
from prismgate.instruments.packs.report import (
    DEFAULT_FOLDS,
    FoldFit,
    Separation,
    SeparationReport,
    fit_folds,
    separation,
    separation_report,
)
from prismgate.instruments.packs.show import describe, readouts

# Everything this module offered before it was split up stays importable from here.
__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_FOLDS",
    "DEFAULT_LAYERS",
    "DEFAULT_LAYERS_NOTE",
    "DEFAULT_PACK",
    "OUTLIER_FACTOR",
    "PROMPT_SETS_DIR",
    "SKIP_FIRST",
    "FoldFit",
    "PromptMeans",
    "PromptSet",
    "Separation",
    "SeparationReport",
    "build_pack",
    "build_pack_and_report",
    "check_layers",
    "collect_prompt_means",
    "collect_token_projections",
    "concept_centers",
    "concept_scales",
    "describe",
    "direction",
    "fit_folds",
    "load_model",
    "load_prompt_sets",
    "main",
    "prompt_sets_digest",
    "readouts",
    "separation",
    "token_keep",
]

PROMPT_SETS_DIR = Path(__file__).parent / "prompt_sets"
DEFAULT_PACK = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"

# Chosen for SmolLM2-135M-Instruct (30 layers) from the held-out separation report of the shipped
# prompt sets (`prismgate concepts build --report-layers all --report`, 4 folds). Every concept is
# separated at the prompt level from layer 0 on (mean accuracy 0.95-0.99), so the choice follows
# token accuracy, which is what a served readout is: 0.68 at L0, 0.75 at L4-L9 (lexical features),
# rising to 0.83 at L12 and a plateau of 0.87-0.89 from L14 to L28 (Cohen's d peaks at L16, 7.1);
# the last layer drops to 0.79 (its output is shaped for the unembedding), so it is left out.
# Two early layers show the lexical stage; six cover the plateau.
DEFAULT_LAYERS: tuple[int, ...] = (4, 8, 12, 16, 19, 22, 25, 28)
DEFAULT_LAYERS_NOTE = (
    "layers 4,8,12,16,19,22,25,28 of 30 chosen from the held-out separation report "
    "(prismgate concepts build --report-layers all --report): held-out token accuracy, averaged over concepts, "
    "is 0.76/0.75 at L4/L8 (lexical stage), 0.83 at L12, 0.87-0.89 from L14 to L28, 0.79 at the last layer (excluded)"
)

SCALES_METHOD = (
    "scales: scale = 0.5 * (mean over positive prompts - mean over negative prompts) of the same prompt "
    "readouts, per concept and layer: (value - center) / scale is +1 at the typical positive prompt"
)


def concept_scales(
    sets: Sequence[PromptSet], prompts: CapturedPrompts, layers: Sequence[int], directions: npt.NDArray[np.float32]
) -> npt.NDArray[np.float32]:
    """``[n_layers, n_concepts]`` float32: half the gap between each set's mean positive and negative readout.

    A display needs one yardstick per concept and layer that does not move with the text shown:
    scaled to the largest value of each answer, a French answer shaded by ``code`` looks as
    saturated as real code. The pack's own contrast is that yardstick: ``(value - center) / scale``
    is +1 where the typical positive prompt sits and -1 at the typical negative one. It is > 0 by
    construction (the direction is the normalised gap between the two means).
    """
    scales = np.zeros(directions.shape[:2], dtype=np.float64)
    for li, layer in enumerate(layers):
        for ci, s in enumerate(sets):
            d = directions[li, ci].astype(np.float64)
            pos = float((prompts.means(s.positive, layer) @ d).mean())
            neg = float((prompts.means(s.negative, layer) @ d).mean())
            scales[li, ci] = 0.5 * (pos - neg)
    return scales.astype(np.float32)


def build_pack_and_report(
    model_dir: str | Path,
    prompt_sets: Sequence[PromptSet | str | Path],
    layers: Sequence[int],
    *,
    model_id: str | None = None,
    report_layers: Sequence[int] | None = None,
    folds: int = DEFAULT_FOLDS,
    dtype: str = "auto",
    device: str = "cpu",
    batch_size: int = DEFAULT_BATCH,
    skip_first: int = SKIP_FIRST,
    outlier_factor: float | None = OUTLIER_FACTOR,
    threads: int = 1,
    layer_note: str = "",
    model: Any = None,
    tokenizer: Any = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[ConceptPack, SeparationReport | None]:
    """Build a pack at ``layers`` and, if ``report_layers`` is given, a held-out separation report there.

    ``model``/``tokenizer`` may be passed already loaded (``dtype``/``device`` are then unused);
    otherwise they are loaded from ``model_dir`` by the engine's loader. ``layer_note`` (why
    these layers) is appended to the pack's ``method``. ``progress``, if given, hears how far each
    pass over the prompts has got.
    """
    sets = checked_sets(prompt_sets)
    if model is None or tokenizer is None:
        model, tokenizer = load_model(model_dir, dtype=dtype, device=device)
    n_layers = len(decoder_layers(model))
    layers = check_layers(layers, n_layers)
    wanted = (
        layers if report_layers is None else tuple(sorted(set(layers) | set(check_layers(report_layers, n_layers))))
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    capture = Capture(batch_size=batch_size, skip_first=skip_first, outlier_factor=outlier_factor, pad_id=pad)
    passes = 1 if report_layers is None else 2
    if progress is not None:
        say = progress
        capture = replace(capture, on_batch=lambda done, total: say(f"pass 1/{passes}: batch {done}/{total}"))
    prompts = capture_prompts(model, tokenizer, sets, wanted, capture, threads)
    directions = concept_directions(sets, prompts, layers)
    pack = ConceptPack(
        directions=directions,
        layers=layers,
        concepts=tuple(s.name for s in sets),
        model_id=model_id or Path(model_dir).resolve().name,
        method=method_text(
            sets, capture, dtype=str(next(model.parameters()).dtype).removeprefix("torch."), layer_note=layer_note
        )
        + "; "
        + SCALES_METHOD,
        descriptions={s.name: s.description for s in sets},
        centers=concept_centers(sets, prompts, layers, directions),
        scales=concept_scales(sets, prompts, layers, directions),
    )
    report = None
    if report_layers is not None:
        report_at = tuple(sorted(set(report_layers)))
        if progress is not None:
            capture = replace(capture, on_batch=lambda done, total: say(f"pass 2/2: batch {done}/{total}"))
        report = separation_report(model, sets, prompts, capture, report_at, folds=folds, threads=threads)
    return pack, report


def build_pack(
    model_dir: str | Path, prompt_sets: Sequence[PromptSet | str | Path], layers: Sequence[int], **options: Any
) -> ConceptPack:
    """A concept pack for the model in ``model_dir``; see :func:`build_pack_and_report` for options."""
    options.pop("report_layers", None)
    return build_pack_and_report(model_dir, prompt_sets, layers, **options)[0]


def main(argv: Sequence[str] | None = None) -> int:
    """``prismgate concepts {build,show} ...``: see :func:`prismgate.instruments.packs.cli.main`."""
    from prismgate.instruments.packs.cli import main as cli_main  # cli imports this module's defaults

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
