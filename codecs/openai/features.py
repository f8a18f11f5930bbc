"""The ``"features"`` extension: SAE features per token, asked beside ``"readouts"``.

Request: ``"features": true`` (the 8 most active features at every SAE layer) or
``{"top_k": 8, "layers": [15], "ids": [12, 345]}``: ``top_k`` features per token and layer
(0-64; 0 with ``ids``: only the watched ones), ``layers`` the SAE layers to read (default:
all), ``ids`` features whose activation is reported at every token whether active or not.

Response, per choice (or chunk) under ``prismgate.features``, one entry per token::

    {"position": 40, "id": 504, "token": "The",
     "layers": [{"layer": 15, "top": [{"id": 1234, "activation": 5.25, "label": "..."}], "watched": [0.0, 1.5]}]}

``label`` appears where the SAE's labels file names the feature; ``watched`` follows ``ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prismgate.codecs.openai.errors import bad_request
from prismgate.core.errors import GatewayError
from prismgate.core.features import FeatureManifest, Features, FeatureSpec

_KEYS = ("top_k", "layers", "ids")


def _ints(value: Any, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise bad_request(f"'features.{name}' must be an array of integers", f"features.{name}")
    return tuple(value)


def parse_features(value: Any) -> FeatureSpec | None:
    """The request's ``features`` field; every number it holds is checked here, before any work."""
    if value is None or value is False:
        return None
    if value is True:
        return FeatureSpec()
    if not isinstance(value, dict):
        raise bad_request(
            '\'features\' must be true or an object {"top_k": 8, "layers": [...], "ids": [...]}', "features"
        )
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise bad_request(f"'features' has unknown keys {unknown}; it takes {', '.join(_KEYS)}", "features")
    top_k = value.get("top_k", 8 if "ids" not in value else 0)
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise bad_request("'features.top_k' must be an integer", "features.top_k")
    layers, ids = _ints(value.get("layers"), "layers"), _ints(value.get("ids"), "ids")
    try:
        return FeatureSpec(top_k=top_k, layers=layers or (), ids=ids or ())
    except GatewayError as exc:
        raise bad_request(exc.message, "features") from None


def describe(spec: FeatureSpec) -> dict[str, Any]:
    """What the numbers mean, once per response (the first chunk of a stream)."""
    return {"layers": list(spec.layers), "top_k": spec.top_k, "ids": list(spec.ids)}


def token_features(
    position: int, token_id: int, text: str, features: Features, manifest: FeatureManifest | None
) -> dict[str, Any]:
    layers = []
    for i, layer in enumerate(features.layers):
        index = manifest.layers.index(layer) if manifest is not None else -1
        top = []
        for f, v in zip(features.ids[i].tolist(), features.values[i].tolist(), strict=True):
            item: dict[str, Any] = {"id": f, "activation": v}
            label = manifest.label(index, f) if manifest is not None else None
            if label is not None:
                item["label"] = label
            top.append(item)
        entry: dict[str, Any] = {"layer": layer, "top": top}
        if features.watched is not None:
            entry["watched"] = features.watched[i].tolist()
        layers.append(entry)
    return {"position": position, "id": token_id, "token": text, "layers": layers}


def features_of(tokens: Sequence[Any], manifest: FeatureManifest | None) -> list[dict[str, Any]]:
    """The ``features`` list of a choice: each token that carries features, in order."""
    return [token_features(t.position, t.id, t.text, t.features, manifest) for t in tokens if t.features is not None]
