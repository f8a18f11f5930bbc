"""Describe a concept pack for people: its metadata, how alike its concepts are, and the readouts of a text.

The readouts of a text are taken through the serving engine's own
:class:`~prismgate.engines.readouts.probe.ReadoutProbe`, so what is printed is what the gateway serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from prismgate.core.errors import invalid
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.readouts.probe import ReadoutProbe
from prismgate.engines.readouts.table import Columns, ReadoutTable
from prismgate.instruments.packs.capture import deterministic_torch


def describe(pack: ConceptPack) -> dict[str, Any]:
    """The pack's metadata as a JSON-ready dict (``prismgate concepts show --json``)."""
    return {
        "model_id": pack.model_id,
        "layers": list(pack.layers),
        "hidden_size": pack.hidden_size,
        "concepts": {c: pack.descriptions.get(c, "") for c in pack.concepts},
        "shape": list(pack.directions.shape),
        "centers": None if pack.centers is None else [[float(v) for v in row] for row in pack.centers],
        "scales": None if pack.scales is None else [[float(v) for v in row] for row in pack.scales],
        "steering": None if pack.steering is None else {c: r.to_json() for c, r in pack.steering.items()},
        "method": pack.method,
    }


def print_summary(pack: ConceptPack, source: str | Path) -> None:
    """The pack's metadata, one field a line, concepts with their descriptions."""
    print(f"pack       {source}")
    print(f"model      {pack.model_id}")
    print(f"layers     {', '.join(map(str, pack.layers))}  (residual stream after decoder layer L)")
    print(f"hidden     {pack.hidden_size}")
    print("concepts")
    width = max(len(c) for c in pack.concepts)
    for c in pack.concepts:
        print(f"  {c:<{width}}  {pack.descriptions.get(c, '')}")
    print_centers(pack)
    print_scales(pack)
    print_steering(pack)
    print(f"method     {pack.method}")


def print_centers(pack: ConceptPack) -> None:
    """Each concept's center per layer (concepts down, layers across), or a note that the pack has none."""
    if pack.centers is None:
        print("centers    none (a pack built before centers existed: rebuild it to get them)")
        return
    print("centers    midpoint of the positive and negative prompts' mean readout (subtract it to read a value)")
    _print_table(pack, pack.centers)


def print_scales(pack: ConceptPack) -> None:
    """Each concept's calibrated scale per layer (the playground's fixed colour scale), or a note that it has none.

    With the centers they say how far a readout is: ``(value - center) / scale`` is +1 where
    the typical positive prompt sits and -1 at the typical negative one.
    """
    if pack.scales is None:
        print("scales     none (a pack built before scales existed: rebuild it to get them)")
        return
    print("scales     half the gap between the positive and negative prompts' mean readout ((value - center) / scale)")
    _print_table(pack, pack.scales)


def print_steering(pack: ConceptPack) -> None:
    """Where each concept steers, as the builder measured it, or a note that the pack was built before it did."""
    if pack.steering is None:
        print("steering   not measured (a pack built before steering was measured: rebuild it to get it)")
        return
    print("steering   measured: the layer, starting scale and fluent range to steer each concept with, and the effect")
    width = max(len(c) for c in pack.concepts)
    print(" " * (width + 2) + f"{'layer':>7}{'scale':>7}{'range':>7}{'effect':>8}")
    for c in pack.concepts:
        r = pack.steering.get(c)
        if r is None:
            print(f"  {c:<{width}}  never fluent at the smallest scale measured")
        else:
            print(f"  {c:<{width}}{'L' + str(r.layer):>7}{r.scale:>+7g}{r.range:>7g}{r.effect:>+8.2f}")


def _print_table(pack: ConceptPack, values: npt.NDArray[np.float32]) -> None:
    """``values[n_layers, n_concepts]`` as concepts down, layers across."""
    width = max(len(c) for c in pack.concepts)
    print(" " * (width + 2) + "".join(f"{'L' + str(layer):>9}" for layer in pack.layers))
    for ci, c in enumerate(pack.concepts):
        print(f"  {c:<{width}}" + "".join(f"{float(v):>9.2f}" for v in values[:, ci]))


def print_similarity(pack: ConceptPack) -> None:
    """Cosine similarity between the concepts, one table per layer: concepts that overlap read alike."""
    for i, layer in enumerate(pack.layers):
        sim = pack.directions[i] @ pack.directions[i].T
        print(f"cosine similarity at layer {layer}:")
        width = max(len(c) for c in pack.concepts)
        print(" " * (width + 2) + "".join(f"{c[:7]:>8}" for c in pack.concepts))
        for c, simrow in zip(pack.concepts, sim, strict=True):
            print(f"  {c:<{width}}" + "".join(f"{v:>8.2f}" for v in simrow))


def readouts(model: Any, tokenizer: Any, pack: ConceptPack, text: str) -> tuple[list[int], npt.NDArray[np.float32]]:
    """(token ids, ``[tokens, n_layers, n_concepts]`` readouts) of a text, through the engine's probe."""
    import torch

    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise invalid("the text has no tokens")
    probe = ReadoutProbe(model, pack)
    try:
        probe.enabled = True
        with deterministic_torch(1):
            model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), use_cache=False)
        return ids, probe.take()
    finally:
        probe.remove()


def print_readouts(model: Any, tokenizer: Any, pack: ConceptPack, text: str, columns: Columns) -> None:
    """Each token of ``text`` after the first, in the table ``prismgate generate --readouts`` prints.

    Position 0 is left out: the attention sink's norm is in the thousands, so its readouts are not
    comparable with any other position's. The logprob column stays empty (the text is given, not sampled).
    """
    ids, values = readouts(model, tokenizer, pack, text)
    table = ReadoutTable(pack.manifest, columns)
    print("\n".join(table.header()))
    for position in range(1, len(ids)):
        print(table.row(position, tokenizer.decode([ids[position]]), None, values[position]))
