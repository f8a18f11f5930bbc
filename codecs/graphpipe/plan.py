"""An InferRequest -> one planned core turn per row, and the shape of the answer.

The whole request is validated before any row runs: the config, the outputs, the input
tensors (in a worker thread: decoding a large tensor takes time), then each row is
planned by the core (:meth:`SessionService.plan_turn`: the prompt rendered with the
model's chat template unless ``config.chat_template`` is false, ``max_tokens`` chosen
and checked against the context, logprobs and readouts over the generated tokens).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from prismgate.codecs.graphpipe.config import DEFAULT_MAX_TOKENS, Config, parse_config
from prismgate.codecs.graphpipe.inputs import Rows, bind_inputs
from prismgate.codecs.graphpipe.outputs import FEATURE_OUTPUTS, Shape, readout_layers, resolve_outputs
from prismgate.codecs.graphpipe.wire import InferCall
from prismgate.core.chat import Message, TextPart
from prismgate.core.errors import GatewayError, invalid
from prismgate.core.prompts import Messages, PromptSource, Tokens
from prismgate.core.service import SessionService
from prismgate.core.turns import ChatTurn, Turn

ORIGIN = "graphpipe"


@dataclass(slots=True)
class Plan:
    """Everything needed to run the rows and shape the answer."""

    turns: list[Turn]
    shape: Shape

    @property
    def detokenize(self) -> bool:
        return "text" in self.shape.outputs


def _read(call: InferCall, service: SessionService, model: str, max_batch: int) -> tuple[Config, Shape, Rows]:
    config = parse_config(call.config, service.budget)
    outputs = resolve_outputs(call.output_names, config)
    layers = None
    if "readouts" in outputs or config.readout_layers is not None:
        try:
            manifest = service.readouts(model)  # the core's answer: INVALID_ARGUMENT without a concept pack
        except GatewayError as exc:
            raise exc.within("output 'readouts'" if "readouts" in outputs else "config.readout_layers") from None
        layers = readout_layers(config, manifest)
    config.sampling()  # the values' own rules, before any input is decoded
    top_k = config.logprobs if {"top_logprob_ids", "top_logprobs"} & set(outputs) else 0
    features = config.features
    if set(FEATURE_OUTPUTS) & set(outputs):
        if features is None:
            raise invalid(f"outputs {', '.join(FEATURE_OUTPUTS)} need config.features (true, or top_k, layers, ids)")
        if "watched_features" in outputs and not features.ids:
            raise invalid("output watched_features needs config.features.ids (the features to watch)")
    elif features is not None:
        raise invalid(f"config.features asks for features: name one of the outputs {', '.join(FEATURE_OUTPUTS)}")
    return config, Shape(outputs, top_k, layers, features), bind_inputs(call, max_batch)


async def make_plan(service: SessionService, call: InferCall, max_batch: int, model: str | None = None) -> Plan:
    """Validate the whole request (inputs, config, outputs) and plan every row before any runs."""
    info = service.info(model)
    config, shape, rows = await asyncio.to_thread(_read, call, service, info.model_id, max_batch)
    wants_logprobs = bool({"logprobs", "top_logprob_ids", "top_logprobs"} & set(shape.outputs))
    sampling = replace(config.sampling(), logprob_top_k=shape.top_k, features=shape.features)
    prompts: list[PromptSource]
    if rows.tokens is not None:
        prompts = [Tokens(tuple(row)) for row in rows.tokens]
    else:
        prompts = [
            Messages([Message("user", [TextPart(text)])], chat_template=config.chat_template)
            for text in rows.prompts or []
        ]
    turns = []
    for i, prompt in enumerate(prompts):
        turn = ChatTurn(
            prompt=prompt,
            origin=ORIGIN,
            sampling=sampling,
            max_tokens=config.max_tokens,
            default_max_tokens=DEFAULT_MAX_TOKENS,
            logprobs=wants_logprobs,
            readouts="readouts" in shape.outputs,
            detokenize="text" in shape.outputs,
        )
        try:
            turns.append(await service.plan_turn(turn, model=info.model_id))
        except GatewayError as exc:
            raise exc.within(f"row {i}") from None
    if shape.features is not None and turns:  # the core filled in the layers: the same for every row
        shape = replace(shape, features=turns[0].action.spec.features)
    return Plan(turns, shape)
