"""An OpenAI request -> a core :class:`~prismgate.core.turns.ChatTurn`, planned by the core.

Translation only: OpenAI's fields become the turn's prompt (messages, text or token
ids), sampling knobs, ``max_tokens`` (none: the rest of the context, or
``openai_default_max_tokens`` when set) and reports; the core decides everything else.
A ``session_id`` turn sends only its new messages, so its prompt is placed as a
continuation of the session (``Placement.CONTINUE``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import numpy as np

from prismgate.codecs.openai.errors import bad_request, from_gateway
from prismgate.codecs.openai.readouts import ReadoutAxes, as_readouts_param, readout_axes
from prismgate.codecs.openai.request import ChatRequest, Common, CompletionRequest
from prismgate.codecs.steering import read_steering
from prismgate.core.actions import Fork, GenerateSpec
from prismgate.core.errors import Code, GatewayError
from prismgate.core.features import FeatureManifest, FeatureSpec
from prismgate.core.models import UnknownModel
from prismgate.core.prompts import Messages, Placement, PromptSource, Text, Tokens
from prismgate.core.service import SessionService
from prismgate.core.turns import ChatTurn, Turn
from prismgate.settings import Settings

ORIGIN = "openai"
SEEDS = 2**63  # the engine's seeds are in [0, 2**63)


@dataclass(slots=True)
class Plan:
    """Everything decided before the engine runs."""

    model: str
    turn: Turn
    session_id: str | None
    echo_text: str | None  # completions with echo: the prompt as text
    axes: ReadoutAxes | None
    want_logprobs: bool
    logprobs_binary: np.dtype | None = None  # base64 logprobs (prismgate.logprobs) instead of OpenAI's form
    top_logprobs: int = 0  # alternatives per token
    features: FeatureSpec | None = None  # as planned by the core: its layers filled in
    feature_manifest: FeatureManifest | None = None  # labels, by layer
    structured_param: str | None = None  # the field that asked for a grammar (its compile errors name it)
    tool_calls: bool = False  # the answer's <tool_call> blocks become tool_calls (codecs/openai/tools.py)


async def plan_chat(service: SessionService, settings: Settings, req: ChatRequest) -> Plan:
    common, tools = req.common, req.tools
    uses_tools = any(m.tool_calls or m.tool_call_id is not None for m in req.messages)
    if (tools is not None or uses_tools) and not service.info(common.model).tokenizer.renders_tools:
        raise bad_request(
            f"the chat template of model {common.model!r} does not support tools (tool calls or results)",
            "tools" if tools is not None else "messages",
        )
    if tools is None:
        return await _plan(service, settings, common, Messages(req.messages), echo=False)
    if tools.constraint is not None:  # required, or a named function: the answer is calls, by grammar
        common = replace(common, structured=tools.constraint, structured_param="tool_choice")
    plan = await _plan(service, settings, common, Messages(req.messages, tools=tools.definitions), echo=False)
    plan.tool_calls = True
    return plan


async def plan_completion(service: SessionService, settings: Settings, req: CompletionRequest) -> Plan:
    prompt: PromptSource = Text(req.prompt) if isinstance(req.prompt, str) else Tokens(req.prompt)
    plan = await _plan(service, settings, req.common, prompt, echo=req.echo)
    if req.echo:  # decoded once the core has checked the prompt against the context
        plan.echo_text = (
            req.prompt if isinstance(req.prompt, str) else service.info(plan.model).tokenizer.decode(req.prompt)
        )
    return plan


async def _plan(
    service: SessionService, settings: Settings, common: Common, prompt: PromptSource, *, echo: bool
) -> Plan:
    axes = None
    if common.readouts is not None:
        try:
            manifest = service.readouts(common.model)
        except UnknownModel:
            raise
        except GatewayError as exc:
            raise as_readouts_param(exc) if exc.code is Code.INVALID_ARGUMENT else exc from None
        axes = readout_axes(manifest, common.readouts)
    if common.structured is not None:
        try:
            service.budget.check_structured(common.structured)
        except GatewayError as exc:
            raise from_gateway(exc, param=common.structured_param) from None
    try:
        steering = read_steering(common.steering, service.budget)
        if steering:
            service.check_steering(steering, common.model)
    except UnknownModel:
        raise
    except GatewayError as exc:
        raise from_gateway(exc, param="steering") if exc.code is Code.INVALID_ARGUMENT else exc from None
    turn = ChatTurn(
        prompt=prompt,
        origin=ORIGIN,
        sampling=GenerateSpec(
            temperature=common.temperature,
            top_p=common.top_p,
            top_k=common.top_k,
            seed=common.seed,
            deterministic=common.deterministic,
            stop_strings=common.stop,
            ignore_eos=common.sampling.ignore_eos,
            min_tokens=common.sampling.min_tokens,
            stop_token_ids=common.sampling.stop_token_ids,
            include_stop_str_in_output=common.sampling.include_stop_str_in_output,
            stop_token_text=common.sampling.include_stop_str_in_output,
            presence_penalty=common.sampling.presence_penalty,
            frequency_penalty=common.sampling.frequency_penalty,
            repetition_penalty=common.sampling.repetition_penalty,
            logit_bias=common.sampling.logit_bias,
            min_p=common.sampling.min_p,
            logprob_top_k=common.top_logprobs or 0,
            steering=steering,
            features=common.features,
            structured=common.structured,
        ),
        max_tokens=common.max_tokens,
        default_max_tokens=settings.openai.default_max_tokens,
        logprobs=common.top_logprobs is not None,
        readouts=axes is not None,
        report_prompt=echo,
        placement=Placement.CONTINUE,
    )
    try:
        planned = await service.plan_turn(turn, session_id=common.session_id, model=common.model)
    except UnknownModel:
        raise
    except GatewayError as exc:
        if exc.code is Code.NOT_FOUND and common.session_id is not None:
            raise from_gateway(exc, param="session_id", code="session_not_found") from None
        if exc.code is Code.INVALID_ARGUMENT and common.features is not None and "feature" in exc.message:
            raise from_gateway(exc, param="features") from None
        raise
    features = planned.action.spec.features
    return Plan(
        model=common.model,
        turn=planned,
        session_id=common.session_id,
        echo_text=None,
        axes=axes,
        want_logprobs=common.top_logprobs is not None,
        logprobs_binary=common.logprobs_binary,
        top_logprobs=common.top_logprobs or 0,
        features=features,
        feature_manifest=service.info(planned.model).features if features is not None else None,
        structured_param=common.structured_param if common.structured is not None else None,
    )


def choice_plans(plan: Plan, n: int) -> list[Plan]:
    """``plan`` for each of ``n`` choices: choice ``i`` samples with seed ``seed + i`` (mod 2**63), as vLLM
    derives its choices' seeds, so a seeded request gives the same choices every time; unseeded, each draws
    its own. Each choice is its own generation of the same planned prompt; the first one's prefill is
    kept for the others (:class:`~prismgate.core.actions.Fork`), which start once it has run."""
    spec = plan.turn.action.spec
    if n == 1:
        return [plan]
    key = secrets.token_hex(8)
    out = []
    for i in range(n):
        seed = None if spec.seed is None else (spec.seed + i) % SEEDS
        fork = Fork(key, followers=n - 1 if i == 0 else 0)
        action = replace(plan.turn.action, spec=replace(spec, seed=seed), fork=fork)
        out.append(replace(plan, turn=replace(plan.turn, action=action)))
    return out
