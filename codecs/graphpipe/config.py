"""The request's ``config`` string: a JSON object of :data:`CONFIG_KEYS`, checked key by key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prismgate.codecs import json_input
from prismgate.codecs.features import read_features
from prismgate.codecs.steering import read_steering
from prismgate.core.actions import MAX_TOP_LOGPROBS, GenerateSpec
from prismgate.core.budget import RequestBudget
from prismgate.core.errors import GatewayError, invalid
from prismgate.core.features import FeatureSpec
from prismgate.core.steering import Steering

DEFAULT_MAX_TOKENS = 16  # when config names none, capped by the room left in the context

CONFIG_KEYS: dict[str, str] = {
    "max_tokens": "integer >= 0: tokens to generate per row (default 16)",
    "temperature": "number >= 0: 0 is greedy (default 0)",
    "top_p": "number in (0, 1] (default 1: off)",
    "top_k": "integer >= 0 (default 0: off)",
    "seed": "integer in [0, 2**63) or null: sampling seed, the same for every row",
    "stop": "string or list of strings: stop when the text contains one (it is not returned)",
    "stop_token_ids": "list of token ids that end a row (besides the model's EOS)",
    "chat_template": "boolean: render prompt rows with the model's chat template (default true)",
    "logprobs": f"integer in [0, {MAX_TOP_LOGPROBS}]: k, the alternatives per token in top_logprob_ids/top_logprobs",
    "readout_layers": "list of layer indices, a subset of the concept pack's layers, in the order wanted",
    "steering": "list of steering entries, the same for every row (see docs/steering.md)",
    "features": "true or {top_k, layers, ids}: the SAE features of each generated token in the feature_ids, "
    "feature_values and watched_features outputs (docs/sae.md)",
    "deterministic": "boolean or null: the same outputs whatever else runs (docs/determinism.md); null: the server's",
}


_SPEC = GenerateSpec()  # the core's defaults


@dataclass(frozen=True, slots=True)
class Config:
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, capped by the room left
    temperature: float = _SPEC.temperature
    top_p: float = _SPEC.top_p
    top_k: int = _SPEC.top_k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    chat_template: bool = True
    logprobs: int = 0
    readout_layers: tuple[int, ...] | None = None
    steering: Steering = ()
    deterministic: bool | None = None
    features: FeatureSpec | None = None

    def sampling(self) -> GenerateSpec:
        """The core's sampling knobs (the core sets max_tokens and what is reported); checks the values."""
        return GenerateSpec(
            max_tokens=self.max_tokens or 0,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            stop_strings=self.stop,
            steering=self.steering,
            deterministic=self.deterministic,
        )


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"config.{key} must be an integer, got {json.dumps(value)}")
    return value


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"config.{key} must be a number, got {json.dumps(value)}")
    return float(value)


def _int_list(key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise invalid(f"config.{key} must be a list of integers, got {json.dumps(value)}")
    return tuple(_int(f"{key}[{i}]", v) for i, v in enumerate(value))


def parse_config(raw: bytes, budget: RequestBudget) -> Config:
    """The request's ``config`` string: empty, or a JSON object of :data:`CONFIG_KEYS`."""
    if not raw.strip():
        return Config()
    try:
        data = json_input.loads(raw, budget, "config")
    except GatewayError as exc:
        raise invalid(f"config must be a JSON object: {exc.message}") from None
    if not isinstance(data, dict):
        raise invalid(f"config must be a JSON object, got a JSON {type(data).__name__}")
    unknown = sorted(set(data) - set(CONFIG_KEYS))
    if unknown:
        raise invalid(f"unknown config key(s) {', '.join(map(repr, unknown))}; known: {', '.join(CONFIG_KEYS)}")
    values: dict[str, Any] = {}
    for key in ("max_tokens", "top_k", "logprobs"):
        if key in data:
            values[key] = _int(key, data[key])
    if not 0 <= values.get("logprobs", 0) <= MAX_TOP_LOGPROBS:
        raise invalid(f"config.logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {values['logprobs']}")
    for key in ("temperature", "top_p"):
        if key in data:
            values[key] = _number(key, data[key])
    if data.get("seed") is not None:
        values["seed"] = _int("seed", data["seed"])
    if "stop" in data:
        stop = data["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise invalid(f"config.stop must be a string or a list of strings, got {json.dumps(stop)}")
        values["stop"] = tuple(stops)
    if "stop_token_ids" in data:
        values["stop_token_ids"] = _int_list("stop_token_ids", data["stop_token_ids"])
    for key in ("chat_template", "deterministic"):
        if data.get(key) is not None:
            if not isinstance(data[key], bool):
                raise invalid(f"config.{key} must be true or false, got {json.dumps(data[key])}")
            values[key] = data[key]
    if "readout_layers" in data:
        values["readout_layers"] = _int_list("readout_layers", data["readout_layers"])
    if "features" in data:
        values["features"] = read_features(data["features"], "config.features")
    if "steering" in data:
        values["steering"] = read_steering(data["steering"], budget, "config.steering")
    return Config(**values)
