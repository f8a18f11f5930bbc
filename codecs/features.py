"""A request's SAE features, as every wire writes them: ``true`` or ``{"top_k", "layers", "ids"}``.

Read into the core's :class:`~prismgate.core.features.FeatureSpec` (which checks the numbers
before any work); a mistake is ``INVALID_ARGUMENT`` naming ``where`` and the key. The OpenAI
``features`` field and GraphPipe's ``config.features`` both come here.
"""

from __future__ import annotations

from typing import Any

from prismgate.core.errors import GatewayError, invalid
from prismgate.core.features import FeatureManifest, Features, FeatureSpec

KEYS = ("top_k", "layers", "ids")


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise invalid(f"'{where}' must be an array of integers")
    return tuple(value)


def read_features(value: Any, where: str = "features") -> FeatureSpec | None:
    """``value`` (None or false: no features; true: the defaults) as a spec; refused naming ``where``."""
    if value is None or value is False:
        return None
    if value is True:
        return FeatureSpec()
    if not isinstance(value, dict):
        raise invalid(f'\'{where}\' must be true or an object {{"top_k": 8, "layers": [...], "ids": [...]}}')
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise invalid(f"'{where}' has unknown keys {unknown}; it takes {', '.join(KEYS)}")
    top_k = value.get("top_k", 8 if "ids" not in value else 0)
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise invalid(f"'{where}.top_k' must be an integer")
    layers, ids = _ints(value.get("layers"), f"{where}.layers"), _ints(value.get("ids"), f"{where}.ids")
    try:
        return FeatureSpec(top_k=top_k, layers=layers, ids=ids)
    except GatewayError as exc:
        raise invalid(exc.message if where == "features" else f"{where}: {exc.message}") from None


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
