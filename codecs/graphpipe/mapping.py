"""GraphPipe tensors <-> generation rows: the tensor mapping, in one place.

Inputs (one of):

* ``prompt``: String, shape ``[batch]`` or scalar; each element is one user message,
  rendered with the model's chat template (``config.chat_template: false`` encodes the
  raw text instead);
* ``tokens``: any integer type (Int32/Int64 usual), shape ``[batch, n]`` or ``[n]``; raw
  token ids, trailing ``-1`` entries are padding (so a ``tokens`` output feeds back in).

``config`` is a JSON object (keys in :data:`CONFIG_KEYS`; unknown keys are an error).

Outputs, each only when named (default ``text``), rows padded to the longest completion:
``text`` String [batch]; ``tokens`` Int32 [batch, m] (pad -1); ``lengths`` Int32 [batch];
``logprobs`` Float32 [batch, m] (pad NaN); ``top_logprob_ids`` Int32 [batch, m, k] (pad -1)
with ``top_logprobs`` Float32 [batch, m, k] (pad NaN), best first; ``readouts`` Float32
[batch, m, n_layers, n_concepts] (pad NaN), layers as in ``config.readout_layers`` or the
concept pack's manifest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from prismgate.codecs.graphpipe.wire import INTEGER_TYPES, InferCall, OutTensor, WireTensor, type_name
from prismgate.core.actions import MAX_TOP_LOGPROBS, GenerateSpec, PositionRange
from prismgate.core.engine import EngineInfo, ReadoutManifest
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.schemas.graphpipe.fb.graphpipe_generated import Type

PROMPT, TOKENS = "prompt", "tokens"
INPUTS = (PROMPT, TOKENS)
DEFAULT_INPUT = PROMPT
OUTPUTS = ("text", "tokens", "lengths", "logprobs", "top_logprob_ids", "top_logprobs", "readouts")
DEFAULT_OUTPUTS = ("text",)
PAD_ID = -1

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
}


_SPEC = GenerateSpec()  # the core's defaults


@dataclass(frozen=True, slots=True)
class Config:
    max_tokens: int = _SPEC.max_tokens
    temperature: float = _SPEC.temperature
    top_p: float = _SPEC.top_p
    top_k: int = _SPEC.top_k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    chat_template: bool = True
    logprobs: int = 0
    readout_layers: tuple[int, ...] | None = None


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


def parse_config(raw: bytes) -> Config:
    """The request's ``config`` string: empty, or a JSON object of :data:`CONFIG_KEYS`."""
    if not raw.strip():
        return Config()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid(f"config must be a JSON object (UTF-8): {exc}") from None
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
    if "chat_template" in data:
        if not isinstance(data["chat_template"], bool):
            raise invalid(f"config.chat_template must be true or false, got {json.dumps(data['chat_template'])}")
        values["chat_template"] = data["chat_template"]
    if "readout_layers" in data:
        values["readout_layers"] = _int_list("readout_layers", data["readout_layers"])
    return Config(**values)


# -- inputs -------------------------------------------------------------------------------


@dataclass(slots=True)
class Rows:
    """The batch, before tokenisation: either text prompts or token-id rows."""

    prompts: list[str] | None = None
    tokens: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.prompts if self.prompts is not None else self.tokens or [])


def bind_inputs(call: InferCall, max_batch: int) -> Rows:
    """Name each input tensor (by ``input_names``, or by its type when none are given)."""
    if not call.inputs:
        raise invalid(f"the request has no input tensors; send one named {' or '.join(map(repr, INPUTS))}")
    if call.input_names:
        if len(call.input_names) != len(call.inputs):
            raise invalid(
                f"{len(call.input_names)} input names for {len(call.inputs)} input tensors; "
                "the spec requires one name per tensor"
            )
        names = call.input_names
    elif len(call.inputs) == 1:
        names = [TOKENS if call.inputs[0].type in INTEGER_TYPES else DEFAULT_INPUT]
    else:
        raise invalid(f"{len(call.inputs)} input tensors without input_names; name them ({', '.join(INPUTS)})")
    for name in names:
        if name not in INPUTS:
            raise invalid(f"unknown input {name!r}; this server takes {' or '.join(map(repr, INPUTS))}")
    if len(set(names)) != len(names):
        raise invalid(f"input names {names} repeat a name")
    if len(names) > 1:
        raise invalid("give either a prompt or a tokens input, not both")
    tensor = call.inputs[0]
    rows = _prompts(tensor) if names[0] == PROMPT else _token_rows(tensor)
    if len(rows) > max_batch:
        raise invalid(f"the batch has {len(rows)} rows; this server takes at most {max_batch} (graphpipe_max_batch)")
    return rows


def _prompts(t: WireTensor) -> Rows:
    if t.type != Type.String:
        raise invalid(f"input 'prompt' must be a String tensor, got {type_name(t.type)}")
    if len(t.shape) > 1:
        raise invalid(f"input 'prompt' must have shape [batch] or be a scalar, got {list(t.shape)}")
    prompts = []
    for i, raw in enumerate(t.strings):
        try:
            prompts.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise invalid(f"prompt row {i} is not valid UTF-8: {raw[:40]!r}") from None
    return Rows(prompts=prompts)


def _token_rows(t: WireTensor) -> Rows:
    if t.type not in INTEGER_TYPES or t.values is None:
        raise invalid(f"input 'tokens' must be an integer tensor (Int32 or Int64), got {type_name(t.type)}")
    if len(t.shape) not in (1, 2):
        raise invalid(f"input 'tokens' must have shape [batch, n] or [n], got {list(t.shape)}")
    matrix = t.values.reshape(1, -1) if len(t.shape) == 1 else t.values
    rows = []
    for row in matrix.tolist():
        while row and row[-1] == PAD_ID:
            row.pop()
        rows.append(row)
    return Rows(tokens=rows)


# -- the plan -----------------------------------------------------------------------------


@dataclass(slots=True)
class Plan:
    """Everything needed to run the rows and shape the answer."""

    rows: list[tuple[int, ...]]
    specs: list[GenerateSpec]
    outputs: list[str]
    detokenize: bool
    top_k: int
    layers: tuple[int, ...] | None  # positions in the manifest's layer list, in output order


def resolve_outputs(names: Sequence[str], config: Config, manifest: ReadoutManifest | None) -> list[str]:
    outputs = list(names) or list(DEFAULT_OUTPUTS)
    for name in outputs:
        if name not in OUTPUTS:
            raise invalid(f"unknown output {name!r}; this server offers {', '.join(OUTPUTS)}")
    if {"top_logprob_ids", "top_logprobs"} & set(outputs) and config.logprobs < 1:
        raise invalid(
            f"outputs top_logprob_ids/top_logprobs need config.logprobs = k in [1, {MAX_TOP_LOGPROBS}] "
            "(the alternatives per token)"
        )
    if "readouts" in outputs and manifest is None:
        raise invalid("output 'readouts' needs a concept pack, and this model has none loaded")
    return outputs


def readout_layers(config: Config, manifest: ReadoutManifest | None) -> tuple[int, ...] | None:
    if config.readout_layers is None:
        return None
    if manifest is None:
        raise invalid("config.readout_layers: this model has no concept pack loaded, so it has no readouts")
    if not config.readout_layers:
        raise invalid("config.readout_layers must name at least one layer")
    if len(set(config.readout_layers)) != len(config.readout_layers):
        raise invalid(f"config.readout_layers {list(config.readout_layers)} repeats a layer")
    missing = [layer for layer in config.readout_layers if layer not in manifest.layers]
    if missing:
        raise invalid(f"config.readout_layers: {missing} not in the concept pack's layers {list(manifest.layers)}")
    return tuple(manifest.layers.index(layer) for layer in config.readout_layers)


def tokenize(rows: Rows, config: Config, info: EngineInfo) -> list[tuple[int, ...]]:
    if rows.tokens is not None:
        return [tuple(r) for r in rows.tokens]
    tok = info.tokenizer
    out = []
    for text in rows.prompts or []:
        if config.chat_template:
            out.append(tuple(tok.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)))
        else:
            out.append(tuple(tok.encode(text)))
    return out


def make_plan(call: InferCall, info: EngineInfo, max_batch: int) -> Plan:
    """Validate the whole request (inputs, config, outputs) before any row runs."""
    config = parse_config(call.config)
    outputs = resolve_outputs(call.output_names, config, info.readouts)
    layers = readout_layers(config, info.readouts)
    rows = tokenize(bind_inputs(call, max_batch), config, info)
    wants_logprobs = bool({"logprobs", "top_logprob_ids", "top_logprobs"} & set(outputs))
    top_k = config.logprobs if {"top_logprob_ids", "top_logprobs"} & set(outputs) else 0

    def spec(generated: tuple[PositionRange, ...] = ()) -> GenerateSpec:
        return GenerateSpec(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            seed=config.seed,
            stop_token_ids=config.stop_token_ids,
            stop_strings=config.stop,
            logprob_ranges=generated if wants_logprobs else (),
            logprob_top_k=top_k,
            readout_ranges=generated if "readouts" in outputs else (),
        )

    specs = [spec((PositionRange(len(row), len(row) + max(config.max_tokens, 0)),)) for row in rows]
    if not rows:  # still validate the config's numbers against the spec's rules
        spec()
    return Plan(rows, specs, outputs, detokenize="text" in outputs, top_k=top_k, layers=layers)


# -- outputs ------------------------------------------------------------------------------


@dataclass(slots=True)
class RowResult:
    """What one row generated (decode positions only, in order)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    readouts: list[npt.NDArray[np.float32] | None] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


def _fill(shape: tuple[int, ...], value: float, dtype: str) -> npt.NDArray[Any]:
    return np.full(shape, value, dtype=dtype)


def assemble(plan: Plan, results: Sequence[RowResult], manifest: ReadoutManifest | None) -> list[OutTensor]:
    batch = len(results)
    m = max((len(r.ids) for r in results), default=0)
    built: dict[str, OutTensor] = {}
    for name in dict.fromkeys(plan.outputs):
        if name == "text":
            built[name] = OutTensor.of_strings(["".join(r.text).encode("utf-8") for r in results])
        elif name == "lengths":
            built[name] = OutTensor.of(Type.Int32, [len(r.ids) for r in results])
        elif name == "tokens":
            ids = _fill((batch, m), PAD_ID, "<i4")
            for i, r in enumerate(results):
                ids[i, : len(r.ids)] = r.ids
            built[name] = OutTensor.of(Type.Int32, ids)
        elif name == "logprobs":
            lp = _fill((batch, m), math.nan, "<f4")
            for i, r in enumerate(results):
                lp[i, : len(r.logprobs)] = r.logprobs
            built[name] = OutTensor.of(Type.Float32, lp)
        elif name in ("top_logprob_ids", "top_logprobs"):
            built[name] = _top(plan.top_k, batch, m, results, ids=name == "top_logprob_ids")
        elif name == "readouts":
            assert manifest is not None
            built[name] = _readouts(plan, batch, m, results, manifest)
        else:  # resolve_outputs admits only known names
            raise GatewayError(Code.INTERNAL, f"output {name!r} has no encoder")
    return [built[name] for name in plan.outputs]


def _top(k: int, batch: int, m: int, results: Sequence[RowResult], *, ids: bool) -> OutTensor:
    out = _fill((batch, m, k), PAD_ID, "<i4") if ids else _fill((batch, m, k), math.nan, "<f4")
    for i, r in enumerate(results):
        for j, alternatives in enumerate(r.top):
            for a, (token, logprob) in enumerate(alternatives[:k]):
                out[i, j, a] = token if ids else logprob
    return OutTensor.of(Type.Int32 if ids else Type.Float32, out)


def _readouts(plan: Plan, batch: int, m: int, results: Sequence[RowResult], manifest: ReadoutManifest) -> OutTensor:
    layers = plan.layers if plan.layers is not None else tuple(range(len(manifest.layers)))
    out = _fill((batch, m, len(layers), len(manifest.concepts)), math.nan, "<f4")
    for i, r in enumerate(results):
        for j, readout in enumerate(r.readouts):
            if readout is not None:
                out[i, j] = np.asarray(readout, dtype=np.float32)[list(layers)]
    return OutTensor.of(Type.Float32, out)
