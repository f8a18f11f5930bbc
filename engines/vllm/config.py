"""What vLLM is started with, and what the engine then reports about the model.

The engine arguments are fixed by what the rest of the engine relies on (prefix caching,
priority scheduling, raw logprobs, prismgate's worker classes), not left to vLLM's defaults.
Parallelism and compilation are vLLM's own, passed through; the KV cache is ``kv_cache_gb``, or
else a share of the device's memory (on CPU, of the memory free at start-up:
:func:`cpu_kv_cache_bytes`). What each setting does on GPU and CPU: docs/vllm.md, "Parallelism"
and "Compilation, memory". vLLM itself is imported only inside the functions that need it, never
at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prismgate.core.engine import EngineInfo, ReadoutManifest
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.features import FeatureManifest
from prismgate.engines.tokenizer import HFTokenizer
from prismgate.engines.vllm.steer import MAX_ROUNDS
from prismgate.engines.vllm.vision import VISION_MODEL_TYPES, vision_tokens
from prismgate.engines.vllm.worker import EXTRA_KEY

CPU_WORKER = "prismgate.engines.vllm.workers.CPUWorker"
GPU_WORKER = "prismgate.engines.vllm.workers.GPUWorker"
LONG_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's own CPU knob (GiB): when set, it wins
GIB = 1 << 30
CPU_KV_CAP_BYTES = 4 * GIB  # the CPU default never takes more than this for the KV cache
CPU_KV_MIN_BYTES = 64 << 20
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's own default; the settings' default is checked equal (tests/test_settings.py)


@dataclass(frozen=True)
class Options:
    """The constructor's choices that shape vLLM's engine (see :class:`~.engine.VLLMEngine`)."""

    model_path: Path
    model_id: str
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    kv_cache_gb: float | None = None
    enforce_eager: bool = False
    concept_pack: Path | None = None
    block_size: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    max_num_seqs: int | None = None
    steering_rounds: int = MAX_ROUNDS  # vectors a request may add at one layer; 0: no steering in the graph
    saes: tuple[tuple[Path, Path | None], ...] = ()  # SAELens folders (and labels files) the workers encode with
    huge_pages: bool = True  # CPU workers move their loaded memory into 2 MiB pages (prismgate.engines.huge_pages)
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
        "enforce_eager": options.enforce_eager,
        "enable_prefix_caching": True,
        "scheduling_policy": "priority",
        "worker_cls": CPU_WORKER if on_cpu else GPU_WORKER,
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "data_parallel_size": options.data_parallel_size,
        "logprobs_mode": "raw_logprobs",
        "max_logprobs": 20,
        "disable_log_stats": True,
        "seed": 0,
        # structured outputs with llguidance, compact JSON: the transformers engine's grammars (engines/hf/grammar.py)
        "structured_outputs_config": {"backend": "guidance", "disable_any_whitespace": True},
    }
    if block is not None:
        kwargs["block_size"] = block
    if options.distributed_executor_backend is not None:  # unset: vLLM's choice (processes on one node)
        kwargs["distributed_executor_backend"] = options.distributed_executor_backend
    worker: dict[str, Any] = {}
    if options.concept_pack is not None:
        # Read by the worker at load time. Also part of the key of vLLM's compile cache: a graph
        # compiled for one pack's shapes must never be loaded for another's, hence the digest.
        digest = hashlib.sha256(options.concept_pack.read_bytes()).hexdigest()[:16]
        worker.update(pack=str(options.concept_pack), digest=digest)
    if options.saes:
        # the worker loads them itself; the digest (configs and weight sizes) keys the compile cache likewise
        worker["saes"] = [str(folder) for folder, _ in options.saes]
        worker["sae_digest"] = sae_digest([folder for folder, _ in options.saes])
    if worker:  # the pack's layers and the SAEs' steer (by feature at the SAEs'), up to this many vectors each
        worker["steering_rounds"] = options.steering_rounds
        kwargs["additional_config"] = {EXTRA_KEY: worker}
    kwargs.update(memory_args(options, on_cpu=on_cpu))
    if options.max_num_seqs is not None:
        kwargs["max_num_seqs"] = options.max_num_seqs
    if model_config(options.model_path).get("model_type") in VISION_MODEL_TYPES:
        kwargs["limit_mm_per_prompt"] = {"image": 64, "video": 0}
    kwargs.update(options.engine_kwargs)
    return kwargs


def sae_digest(folders: list[Path]) -> str:
    """What the compiled graph's shapes depend on: each SAE's config and its weights' size."""
    from prismgate.engines.sae.files import CFG_FILE, WEIGHTS_FILE

    h = hashlib.sha256()
    for folder in folders:
        h.update((folder / CFG_FILE).read_bytes())
        h.update(str((folder / WEIGHTS_FILE).stat().st_size).encode())
    return h.hexdigest()[:16]


def load_saes(options: Options) -> tuple[Any, ...]:
    """The SAEs, checked against the model's layers and width before vLLM starts (a wrong one names its file)."""
    if not options.saes:
        return ()
    from prismgate.engines.sae.files import load_for_model

    if options.pipeline_parallel_size > 1:
        raise invalid(
            "sae: SAE features are not supported with pipeline_parallel_size > 1 on the vllm engine "
            "(a stage would send the features of its own layers only)"
        )
    config = model_config(options.model_path)
    text = config.get("text_config") or config
    return load_for_model(options.saes, int(text["num_hidden_layers"]), int(text["hidden_size"]))


def memory_args(options: Options, *, on_cpu: bool) -> dict[str, Any]:
    """How much memory vLLM may take: a fixed KV cache, or a fraction of the device's memory."""
    fraction = options.gpu_memory_utilization
    if not 0 < fraction <= 1:
        raise invalid(f"gpu_memory_utilization must lie in (0, 1], got {fraction}")
    if options.kv_cache_gb is not None:
        if options.kv_cache_gb <= 0:
            raise invalid(f"the KV cache size must be positive, got {options.kv_cache_gb} GiB")
        return {"kv_cache_memory_bytes": int(options.kv_cache_gb * GIB), "gpu_memory_utilization": fraction}
    if not on_cpu:
        return {"gpu_memory_utilization": fraction}
    if os.environ.get(CPU_KV_ENV):
        return {}  # vLLM reads it itself (and lets it override everything else)
    return {"kv_cache_memory_bytes": cpu_kv_cache_bytes(options, available_memory())}


def cpu_kv_cache_bytes(options: Options, available: int) -> int:
    """The CPU KV cache when none is given: ``gpu_memory_utilization`` of what is free, less the weights.

    vLLM's CPU worker asks for that fraction of the machine's *total* memory and refuses to
    start when other processes hold more than the rest. Here the fraction applies to the
    memory free now, the model's weights (counted at up to float32 width) come off it, and
    the result is capped at :data:`CPU_KV_CAP_BYTES`: a KV cache that large already holds
    hundreds of thousands of tokens of a small model, and pages are shared with other work.
    """
    weights = sum(f.stat().st_size for f in options.model_path.glob("*.safetensors"))
    if options.dtype == "float32":
        weights *= 2  # checkpoints are mostly 16-bit; float32 doubles them in memory
    budget = min(int(options.gpu_memory_utilization * available) - weights, CPU_KV_CAP_BYTES)
    if budget < CPU_KV_MIN_BYTES:
        raise GatewayError(
            Code.RESOURCE_EXHAUSTED,
            f"only {available / GIB:.1f} GiB of memory is free: not enough for the model's weights "
            f"({weights / GIB:.1f} GiB) and a KV cache at gpu_memory_utilization {options.gpu_memory_utilization}; "
            "free memory, raise the fraction, or set the KV-cache size (vllm_kv_cache_gb)",
        )
    return budget


def available_memory() -> int:
    """Bytes of memory free for new work now (the kernel's MemAvailable)."""
    import psutil  # a dependency of vLLM

    return int(psutil.virtual_memory().available)


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


def engine_info(
    options: Options,
    tokenizer: Any,
    vllm_len: int,
    manifest: ReadoutManifest | None,
    features: FeatureManifest | None = None,
    workers: Sequence[Mapping[str, Any]] = (),
) -> EngineInfo:
    """What the engine serves; ``vllm_len`` is vLLM's context, one longer than the one served; ``workers``:
    what each worker's ``prismgate_setup`` answered (here: what it moved into huge pages)."""
    config = model_config(options.model_path)
    text = config.get("text_config") or config
    steers = (manifest is not None or features is not None) and options.steering_rounds > 0
    return EngineInfo(
        model_id=options.model_id,
        max_model_len=vllm_len - 1,
        vocab_size=int(text.get("vocab_size") or config.get("vocab_size") or len(tokenizer)),
        eos_token_ids=eos_ids(options.model_path, config, tokenizer),
        tokenizer=HFTokenizer(tokenizer),
        readouts=manifest,
        vision=vision_tokens(config, tokenizer),
        engine_name="vllm",
        steering=steers,
        steering_gates=steers,  # the engine refuses gates itself under pipeline parallelism
        steering_features=steers and features is not None,  # at the SAEs' layers, in the same op (.sae_steer)
        steering_off="vllm_steering_rounds = 0" if options.steering_rounds == 0 else None,
        deterministic=deterministic_off() is None,
        deterministic_off=deterministic_off(),
        features=features,
        huge_page_bytes=sum(int(w.get("huge_page_bytes", 0)) for w in workers),
        huge_pages_reason=huge_pages_reason(workers),
    )


def huge_pages_reason(workers: Sequence[Mapping[str, Any]]) -> str:
    """What the workers moved into huge pages, in one sentence: the reason itself with one worker."""
    reasons = [str(w["huge_pages_reason"]) for w in workers if w.get("huge_pages_reason")]
    if len(reasons) <= 1:
        return "".join(reasons)
    return "; ".join(f"worker {i}: {reason}" for i, reason in enumerate(reasons))


BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"


def deterministic_off() -> str | None:
    """Why this vLLM cannot run deterministic requests, naming the setting; None when it can.

    vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) is process-wide and GPU only; under
    it vLLM replaces torch's matrix products, which prismgate's readout and steering ops call, with
    its batch-invariant kernels. vllm-cpu has no such mode, so there the refusal says where to go.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return (
            "vLLM on CPU has no batch-invariant mode (VLLM_BATCH_INVARIANT is GPU only); "
            "serve the model with --engine transformers for deterministic requests"
        )
    if os.environ.get(BATCH_INVARIANT_ENV, "0") != "1":
        return f"start the server with {BATCH_INVARIANT_ENV}=1 (vLLM's batch-invariant mode, GPU only)"
    return None
