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

from prismgate.codecs.features import read_features, token_features
from prismgate.codecs.openai.errors import bad_request
from prismgate.core.errors import GatewayError
from prismgate.core.features import FeatureManifest, FeatureSpec


def parse_features(value: Any) -> FeatureSpec | None:
    """The request's ``features`` field; every number it holds is checked here, before any work."""
    try:
        return read_features(value)
    except GatewayError as exc:
        raise bad_request(exc.message, "features") from None


def describe(spec: FeatureSpec) -> dict[str, Any]:
    """What the numbers mean, once per response (the first chunk of a stream)."""
    return {"layers": list(spec.layers), "top_k": spec.top_k, "ids": list(spec.ids)}


def features_of(tokens: Sequence[Any], manifest: FeatureManifest | None) -> list[dict[str, Any]]:
    """The ``features`` list of a choice: each token that carries features, in order."""
    return [token_features(t.position, t.id, t.text, t.features, manifest) for t in tokens if t.features is not None]
