"""``Action`` messages -> what to run: GENERATE's inputs, outputs and config, DROP's and CANCEL's ids.

Everything here is knowable from the action alone, so it is checked when the action
arrives (a bad action aborts the session at once, not when its input tree completes).
Whether the action fits the session and the model is the core's to say.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from prismgate.codecs.binary_numbers import BadEncoding, read_encoding
from prismgate.codecs.evergreen.config import parse_configs
from prismgate.codecs.evergreen.outputs import EXTRA_OUTPUTS, TEXT_OUTPUTS
from prismgate.codecs.features import read_features
from prismgate.codecs.steering import entry_from_message
from prismgate.core.actions import GenerateSpec
from prismgate.core.budget import RequestBudget
from prismgate.core.errors import GatewayError, invalid
from prismgate.core.features import FeatureSpec
from prismgate.core.steering import Comparison, Positions, SteeringEntry
from prismgate.schemas import evergreen_generate_pb2 as gpb
from prismgate.schemas import evergreen_pb2 as pb

INPUT_NAMES = ("prompt", "text")


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """A GENERATE action, read: the input tree's root, the outputs by key, the decoding asked for."""

    root: str
    outputs: dict[str, str]  # "text" | "readouts" | "logprobs" | "usage" -> node id
    config: gpb.GenerateConfig
    sampling: GenerateSpec
    target: str  # the model the client named ("" when none)
    readout_binary: np.dtype | None = None  # the readouts' values as base64 of this dtype; None: JSON numbers
    logprobs_binary: np.dtype | None = None  # the alternatives' logprobs as base64 of this dtype; None: a `top` list

    @property
    def max_tokens(self) -> int | None:
        return self.config.max_tokens if self.config.HasField("max_tokens") else None

    @property
    def chat_template(self) -> bool:
        return self.config.chat_template if self.config.HasField("chat_template") else True


def read_generate(action: pb.Action, label: str, budget: RequestBudget) -> GenerateCall:
    inputs = [(p.name, p.id) for p in action.inputs]
    unknown_in = [n for n, _ in inputs if n not in INPUT_NAMES]
    if unknown_in:
        raise invalid(f"{label}: unknown input {unknown_in[0]!r}; GENERATE takes 'prompt' or 'text'")
    if len(inputs) != 1:
        raise invalid(f"{label}: GENERATE takes exactly one input ('prompt' or 'text'), got {len(inputs)}")
    outputs: dict[str, str] = {}
    for p in action.outputs:
        if p.name not in TEXT_OUTPUTS + EXTRA_OUTPUTS:
            raise invalid(
                f"{label}: unknown output {p.name!r}; GENERATE writes 'response' or 'text', "
                "and optionally 'readouts', 'logprobs', 'features', 'usage'"
            )
        key = "text" if p.name in TEXT_OUTPUTS else p.name
        if key in outputs:
            raise invalid(f"{label}: output {p.name!r} named twice")
        outputs[key] = p.id
    if "text" not in outputs:
        raise invalid(f"{label}: GENERATE needs a 'response' (or 'text') output")
    if len(set(outputs.values())) != len(outputs):
        raise invalid(f"{label}: two outputs share one node id")
    config = parse_configs(action.configs, label, budget)
    try:
        binary = read_encoding(
            config.readout_encoding_format or None,
            config.readout_dtype or None,
            "config.readout_encoding_format",
            "config.readout_dtype",
        )
        logprobs_binary = read_encoding(
            config.logprobs_encoding_format or None,
            config.logprobs_dtype or None,
            "config.logprobs_encoding_format",
            "config.logprobs_dtype",
        )
    except BadEncoding as exc:
        raise invalid(f"{label}: {exc.message}") from None
    if logprobs_binary is not None and "logprobs" not in outputs:
        raise invalid(f"{label}: config.logprobs_encoding_format 'base64' needs a 'logprobs' output")
    spec = replace(sampling(config, budget), features=_features(config, outputs, label))
    return GenerateCall(inputs[0][1], outputs, config, spec, action.target_spec.id, binary, logprobs_binary)


def read_ids(action: pb.Action, label: str, what: str) -> list[str]:
    ids = [p.id for p in action.inputs]
    if not ids:
        raise invalid(f"{label}: {what}")
    return ids


def sampling(config: gpb.GenerateConfig, budget: RequestBudget) -> GenerateSpec:
    """GenerateConfig -> the core's sampling knobs (the core sets max_tokens and what is reported).

    Building the spec checks the values (signs, ranges) as soon as the action arrives.
    """
    return GenerateSpec(
        max_tokens=config.max_tokens,
        temperature=config.temperature if config.HasField("temperature") else 0.0,
        top_p=config.top_p if config.HasField("top_p") else 1.0,
        top_k=config.top_k if config.HasField("top_k") else 0,
        seed=config.seed if config.HasField("seed") else None,
        stop_token_ids=tuple(config.stop_token_ids),
        stop_strings=tuple(config.stop_strings),
        ignore_eos=config.ignore_eos,
        logprob_top_k=config.top_logprobs,
        priority=config.priority,
        steering=_steering(config, budget),
        deterministic=config.deterministic if config.HasField("deterministic") else None,
    )


def _features(config: gpb.GenerateConfig, outputs: dict[str, str], label: str) -> FeatureSpec | None:
    """``config.features`` (read as every wire reads it), or the defaults when only the output names it."""
    if not config.HasField("features"):
        return FeatureSpec() if "features" in outputs else None
    if "features" not in outputs:
        raise invalid(f"{label}: config.features asks for features: add a 'features' output")
    f = config.features
    value: dict[str, object] = {"layers": list(f.layers), "ids": list(f.ids)}
    if f.HasField("top_k"):
        value["top_k"] = f.top_k
    elif not f.ids:
        value.pop("ids")
    try:
        return read_features(value, "config.features")
    except GatewayError as exc:
        raise invalid(f"{label}: {exc.message}") from None


def _steering(config: gpb.GenerateConfig, budget: RequestBudget) -> tuple[SteeringEntry, ...]:
    """The entries, counted before any is read (a direction's length is checked before it is copied)."""
    budget.check_lists(steering_entries=len(config.steering))
    return tuple(_steering_entry(e, i, budget) for i, e in enumerate(config.steering))


def _steering_entry(entry: gpb.SteeringEntry, index: int, budget: RequestBudget) -> SteeringEntry:
    where = f"config.steering[{index}]"
    choices = [p.value for p in Positions]
    if entry.positions and entry.positions not in choices:
        raise invalid(f"{where}.positions must be one of {', '.join(choices)}, got {entry.positions!r}")
    comparison = None
    if entry.HasField("gate"):
        comparisons = [c.value for c in Comparison]
        if entry.gate.comparison not in comparisons:
            raise invalid(
                f"{where}.gate.comparison must be one of {', '.join(comparisons)}, got {entry.gate.comparison!r}"
            )
        comparison = Comparison(entry.gate.comparison)
    return entry_from_message(entry, Positions(entry.positions or Positions.BOTH.value), comparison, where, budget)
