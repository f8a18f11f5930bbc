"""A planned request in vLLM's terms: its ``SamplingParams`` and its ``TokensPrompt``.

Every request streams deltas without detokenizing (the gateway detokenizes), and carries
what the worker should send over the side channel in ``extra_args``. vLLM is imported only
when a request is built, never at import time.
"""

from __future__ import annotations

from typing import Any

from prismgate.core.engine import EngineRequest, VisionTokens
from prismgate.core.errors import invalid
from prismgate.core.structured import Kind, Structured
from prismgate.engines.vllm.plan import Plan
from prismgate.engines.vllm.vision import collapse, decode_image
from prismgate.engines.vllm.worker import EXTRA_KEY


def _params(wants: dict[str, Any] | None, **kwargs: Any) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
        extra_args={EXTRA_KEY: wants} if wants else None,
        **kwargs,
    )


def sampling_params(request: EngineRequest, plan: Plan, wants: dict[str, Any] | None, skip_cache: bool) -> Any:
    """The client's sampling, with stops applied here instead when the request looks ahead.

    Penalties, ``logit_bias``, ``min_p``, ``min_tokens`` and a structured-output grammar go to
    vLLM's own sampler as they are.
    ``min_tokens`` is vLLM's mask of the stop ids, so a request that looks ahead (the engine applies
    its stops) cannot have it: it is refused before anything runs.
    """
    spec = request.spec
    if plan.lookahead:
        if spec.min_tokens:
            raise invalid(
                "min_tokens cannot be combined with readouts or features of generated tokens on the vLLM engine "
                "(their look-ahead step applies the stop ids outside vLLM's sampler)"
            )
        max_tokens, stop_ids = spec.max_tokens + 1, None  # stops are applied by the engine, one step late
    else:
        max_tokens, stop_ids = max(spec.max_tokens, 1), sorted(plan.stop_ids) or None
    # top_k 1 is greedy decoding: vLLM's argmax (the first of equal maxima), never a draw among ties
    greedy = spec.temperature == 0 or spec.top_k == 1
    return _params(
        wants,
        max_tokens=max_tokens,
        temperature=0.0 if greedy else spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed,
        min_p=spec.min_p,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        logit_bias=dict(spec.logit_bias) or None,
        min_tokens=spec.min_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=True,  # EOS ids are in stop_token_ids (or applied by the engine): exactly info.eos_token_ids
        logprobs=spec.logprob_top_k if plan.decode_logprobs else None,
        skip_special_tokens=False,
        skip_reading_prefix_cache=skip_cache,
        structured_outputs=structured_params(spec.structured),
    )


def structured_params(structured: Structured | None) -> Any:
    """The request's grammar as vLLM's own ``StructuredOutputsParams`` (vLLM compiles and applies it)."""
    if structured is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    if structured.kind is Kind.JSON_OBJECT:
        return StructuredOutputsParams(json_object=True)
    if structured.kind is Kind.JSON_SCHEMA:
        return StructuredOutputsParams(json=structured.schema)
    if structured.kind is Kind.CHOICE:
        return StructuredOutputsParams(choice=list(structured.choices))
    if structured.kind is Kind.REGEX:
        return StructuredOutputsParams(regex=structured.source)
    return StructuredOutputsParams(grammar=structured.source)


def rescore_params(wants: dict[str, Any]) -> Any:
    """One greedy step over a prefix with the cache off: only its side-channel values matter."""
    return _params(wants, max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True)


def prompt(request: EngineRequest, salt: str | None, vision: VisionTokens | None) -> Any:
    """The request's tokens (image runs collapsed, images attached), salted for its cache scope."""
    from vllm.inputs import TokensPrompt

    ids = collapse(request.tokens, request.images, vision)
    tokens_prompt = TokensPrompt(prompt_token_ids=ids)
    if salt is not None:
        tokens_prompt["cache_salt"] = salt
    if request.images:
        tokens_prompt["multi_modal_data"] = {"image": [decode_image(im.data, im.mime) for im in request.images]}
    return tokens_prompt
