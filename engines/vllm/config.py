"""What vLLM is started with, and what the engine then reports about the model.

The engine arguments are fixed by what the rest of the engine relies on, not left to vLLM's
defaults: eager mode (forward hooks do not fire inside captured graphs), prefix caching,
priority scheduling, raw logprobs (before temperature and filters, as the contract asks) and
the worker extension that installs the hooks. vLLM's context is one position longer than
the one served, for the look-ahead step (see :mod:`prismgate.engines.vllm.engine`).

vLLM itself is imported only inside the functions that need it, never at import time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prismgate.core.engine import EngineInfo, ReadoutManifest
from prismgate.core.errors import invalid
from prismgate.engines.tokenizer import HFTokenizer
from prismgate.engines.vllm.vision import VISION_MODEL_TYPES, vision_tokens

WORKER_EXTENSION = "prismgate.engines.vllm.worker.PrismgateWorkerExtension"
LONG_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class Options:
    """The constructor's choices that shape vLLM's engine (see :class:`~.engine.VLLMEngine`)."""

    model_path: Path
    model_id: str
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int | None = None
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def model_config(path: Path) -> dict[str, Any]:
    """The model folder's ``config.json``."""
    return dict(json.loads((path / "config.json").read_text()))


def engine_args(options: Options, *, on_cpu: bool) -> dict[str, Any]:
    """``AsyncEngineArgs`` keywords; the caller's ``engine_kwargs`` override everything else."""
    block = options.block_size or (32 if on_cpu else None)  # vLLM's CPU backend wants multiples of 32
    kwargs: dict[str, Any] = {
        "model": str(options.model_path),
        "tokenizer": str(options.model_path),
        "served_model_name": options.model_id,
        "dtype": options.dtype,
        "enforce_eager": True,  # forward hooks do not fire inside captured graphs
        "enable_prefix_caching": True,
        "scheduling_policy": "priority",
        "worker_extension_cls": WORKER_EXTENSION,
        "tensor_parallel_size": options.tensor_parallel_size,
        "logprobs_mode": "raw_logprobs",
        "max_logprobs": 20,
        "disable_log_stats": True,
        "seed": 0,
    }
    if block is not None:
        kwargs["block_size"] = block
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
    if options.max_num_seqs is not None:
        kwargs["max_num_seqs"] = options.max_num_seqs
    if model_config(options.model_path).get("model_type") in VISION_MODEL_TYPES:
        kwargs["limit_mm_per_prompt"] = {"image": 64, "video": 0}
    kwargs.update(options.engine_kwargs)
    return kwargs


def vllm_config(options: Options) -> Any:
    """vLLM's config with one position beyond the served context, for the look-ahead step.

    The extra position only ever holds a sampled token that is thrown away: no position
    at or past the model's own limit is run through the model, so allowing the longer
    length (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``, set only while the config is built) is safe.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    kwargs = engine_args(options, on_cpu=current_platform.is_cpu())
    derived = int(
        AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT).model_config.max_model_len
    )
    limit = options.max_model_len or derived
    if limit > derived:
        raise invalid(f"max_model_len {limit} is longer than this model's context of {derived}")
    kwargs["max_model_len"] = limit + 1
    saved = os.environ.get(LONG_LEN_ENV)
    os.environ[LONG_LEN_ENV] = "1"
    try:
        return AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT)
    finally:
        if saved is None:
            os.environ.pop(LONG_LEN_ENV, None)
        else:
            os.environ[LONG_LEN_ENV] = saved


def eos_ids(path: Path, config: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids: the generation config's, else the model config's, else the tokenizer's."""
    generation = path / "generation_config.json"
    eos: Any = None
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id")
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return tuple(dict.fromkeys(int(i) for i in ids))


def engine_info(options: Options, tokenizer: Any, vllm_len: int, manifest: ReadoutManifest | None) -> EngineInfo:
    """What the engine serves; ``vllm_len`` is vLLM's context, one longer than the one served."""
    config = model_config(options.model_path)
    text = config.get("text_config") or config
    return EngineInfo(
        model_id=options.model_id,
        max_model_len=vllm_len - 1,
        vocab_size=int(text.get("vocab_size") or config.get("vocab_size") or len(tokenizer)),
        eos_token_ids=eos_ids(options.model_path, config, tokenizer),
        tokenizer=HFTokenizer(tokenizer),
        readouts=manifest,
        vision=vision_tokens(config, tokenizer),
        engine_name="vllm",
    )
