"""The top SAE features of each token of a text, as a table (``prismgate sae show --text``)."""

from __future__ import annotations

from typing import Any

import torch

from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import SparseAutoencoder
from prismgate.instruments.sae.train import LayerTap


def top_features(
    model: Any, tokenizer: Any, sae: SparseAutoencoder, text: str, top: int
) -> list[tuple[str, list[tuple[int, float]]]]:
    """(token text, [(feature id, activation), ...] largest first, active ones only) for each token of ``text``."""
    ids = tokenizer(text)["input_ids"]
    encoder = SaeEncoder(sae)
    tap = LayerTap(model, sae.layer, stop=True)
    try:
        with torch.inference_mode():
            feature_ids, values = encoder.top(tap.run(model, input_ids=torch.tensor([ids]))[0], top)
    finally:
        tap.remove()
    rows = []
    for pos, token in enumerate(ids):
        pairs = [(int(f), float(v)) for f, v in zip(feature_ids[pos], values[pos], strict=True) if v > 0]
        rows.append((tokenizer.decode([token]), pairs))
    return rows


def print_features(model: Any, tokenizer: Any, sae: SparseAutoencoder, text: str, top: int) -> None:
    print(f"top {top} features per token, layer {sae.layer} (feature:activation, label):")
    for pos, (token, pairs) in enumerate(top_features(model, tokenizer, sae, text, top)):
        cells = ", ".join(f"{f}:{v:.1f}" + (f" {sae.label(f)!r}" if sae.label(f) else "") for f, v in pairs)
        print(f"  {pos:>3} {token!r:<14} {cells}")
