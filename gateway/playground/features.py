"""The playground's SAE features: what the manifest says about them, and ``GET /playground/features``.

The page shows each token's top features (from the Evergreen ``features`` output and
``/playground/score``) with their labels, and lets a user find a feature to steer or clamp by
searching its label or id: ``/playground/features?q=cat&layer=15&limit=20``. The catalogue is
the served model's SAE labels (its labels file, or the labels ``prismgate sae train`` generated,
docs/sae.md); a feature without a label is found by its id alone. ``q`` and ``limit`` are
checked before any search.
"""

from __future__ import annotations

from typing import Any

from prismgate.core.errors import invalid
from prismgate.core.features import FeatureManifest

TOP_K = 8  # features shown per token and layer
MAX_QUERY_CHARS = 100
MAX_RESULTS = 50
DEFAULT_RESULTS = 20


def features_manifest(m: FeatureManifest | None) -> dict[str, Any] | None:
    """The manifest's ``features``: the SAE layers, their widths, how many labels and where they come from."""
    if m is None:
        return None
    return {
        "layers": list(m.layers),
        "widths": list(m.widths),
        "labelled": [len(labels) for labels in m.labels] if m.labels else [0] * len(m.layers),
        "labelsFrom": list(m.labels_from) if m.labels_from else [""] * len(m.layers),
        "topK": TOP_K,
        "maxResults": MAX_RESULTS,
    }


def _number(text: str | None, name: str, default: int) -> int:
    if text is None or text == "":
        return default
    if not text.isdigit() or len(text) > 9:
        raise invalid(f"{name} must be a non-negative integer, got {text[:20]!r}")
    return int(text)


def search(m: FeatureManifest | None, query: dict[str, str]) -> dict[str, Any]:
    """The features of one SAE layer matching ``q``: the id itself when ``q`` is a number, then labels
    containing ``q`` (case-insensitive), lowest id first, at most ``limit``; ``total`` counts every match."""
    if m is None:
        raise invalid("this model has no sparse autoencoder loaded, so it has no features to search (docs/sae.md)")
    unknown = sorted(set(query) - {"q", "layer", "limit"})
    if unknown:
        raise invalid(f"unknown parameters {unknown}; /playground/features takes q, layer and limit")
    q = query.get("q", "").strip()
    if len(q) > MAX_QUERY_CHARS:
        raise invalid(f"q is {len(q)} characters long; at most {MAX_QUERY_CHARS}")
    limit = _number(query.get("limit"), "limit", DEFAULT_RESULTS)
    if not 1 <= limit <= MAX_RESULTS:
        raise invalid(f"limit must be in [1, {MAX_RESULTS}], got {limit}")
    layer = _number(query.get("layer"), "layer", m.layers[0])
    if layer not in m.layers:
        raise invalid(f"layer {layer} has no SAE; the model's SAEs read after layers {', '.join(map(str, m.layers))}")
    index = m.layers.index(layer)
    labels = m.labels[index] if m.labels else {}
    width = m.widths[index]
    found: list[int] = []
    if q.isdigit() and int(q) < width:
        found.append(int(q))
    needle = q.casefold()
    if needle:
        found += [f for f in sorted(labels) if needle in labels[f].casefold() and f not in found]
    else:  # an empty query lists the labelled features (or, without labels, the first ids)
        found = sorted(labels) or list(range(min(width, MAX_RESULTS)))
    return {
        "layer": layer,
        "q": q,
        "total": len(found),
        "features": [{"id": f, "label": labels.get(f)} for f in found[:limit]],
    }
