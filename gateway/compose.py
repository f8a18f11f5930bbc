"""Wiring: settings -> engines (one per served model) -> pool -> session store -> the core service."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prismgate.core.budget import RequestBudget
from prismgate.core.engine import Engine
from prismgate.core.errors import invalid
from prismgate.core.pool import EnginePool
from prismgate.core.quota import LocalQuota, Quota
from prismgate.core.service import SessionService
from prismgate.core.stores import InProcessStore, SessionStore
from prismgate.engines.models import (
    DEFAULT_MODEL_ID,
    default_model_converted,
    default_model_path,
    default_model_target,
    resolve_model,
)
from prismgate.engines.readouts.auto import cached_pack_path
from prismgate.engines.readouts.auto_engine import AutoPackEngine, ConvertingEngine
from prismgate.engines.readouts.pack import DEFAULT_PACKS
from prismgate.engines.sae.auto import auto_saes
from prismgate.settings import Settings

DEFAULT_PACK = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"


def builds_pack(settings: Settings, served_default: bool) -> bool:
    """Whether the pack is built for the served model (``auto``): asked for, or no shipped pack fits."""
    choice = (settings.concept_pack or "").lower()
    return choice == "auto" or (not choice and not (served_default and DEFAULT_PACK.exists()))


def concept_pack_for(settings: Settings, served_default: bool) -> Path | None:
    """The pack file the engine loads; for ``auto``, the cache file (which may not be built yet)."""
    if builds_pack(settings, served_default):
        folder, _ = resolve_model(settings.model)
        return cached_pack_path(
            settings.concept_pack_cache, folder, pairs=settings.concept_pack_pairs, dtype=settings.dtype
        )
    if settings.concept_pack is not None:
        return None if settings.concept_pack.lower() == "none" else Path(settings.concept_pack)
    return DEFAULT_PACK


def sae_specs(settings: Settings, folder: Path, served_default: bool) -> tuple[tuple[Path, Path | None], ...]:
    """(SAE folder, labels file or None) for each SAE the engine loads: ``sae``'s folders, or ``auto``'s."""
    if not settings.sae:
        return ()
    items = [x.strip() for x in settings.sae.split(",") if x.strip()]
    labels = [x.strip() for x in (settings.sae_labels or "").split(",")]
    if settings.sae_labels and len(labels) > len(items):
        raise invalid(f"sae_labels names {len(labels)} files for {len(items)} SAEs in sae")
    folders: list[Path] = []
    for item in items:
        if item.lower() == "auto":
            folders += auto_saes(settings.sae_cache, folder, served_default, settings.dtype)
        else:
            folders.append(Path(item).expanduser())
    if settings.sae_labels and len(folders) != len(items):
        raise invalid(
            "sae_labels cannot be matched to sae = 'auto' (it may load several layers): "
            "put labels.json files in the SAE folders"
        )
    return tuple(
        (f, Path(labels[i]).expanduser() if i < len(labels) and labels[i] else None) for i, f in enumerate(folders)
    )


def build_engine(settings: Settings) -> Engine:
    if not settings.model and not builds_pack(settings, served_default=True) and not default_model_converted():
        # the first start: the GGUF conversion runs in the engine's start, after the ports are logged
        pack = concept_pack_for(settings, served_default=True)
        model_id = settings.model_name or DEFAULT_MODEL_ID
        saes = sae_specs(settings, default_model_target(), served_default=True)
        return ConvertingEngine(
            lambda built: _serving_engine(settings, default_model_target(), model_id, built, saes),
            default_model_path,
            model_id=model_id,
            pack=pack,
        )
    folder, name = resolve_model(settings.model)
    model_id = settings.model_name or name
    served_default = name == DEFAULT_MODEL_ID and not settings.model
    pack = concept_pack_for(settings, served_default=served_default)
    saes = sae_specs(settings, folder, served_default)
    if pack is not None and builds_pack(settings, served_default):
        return AutoPackEngine(
            lambda built: _serving_engine(settings, folder, model_id, built, saes),
            model_dir=folder,
            model_id=model_id,
            pack_path=pack,
            pairs=settings.concept_pack_pairs,
            dtype=settings.dtype,
            device=settings.device,
            threads=settings.threads or 1,  # one thread unless told: torch threads on a busy machine slow a build down
        )
    return _serving_engine(settings, folder, model_id, pack, saes)


def _serving_engine(
    settings: Settings, folder: Path, model_id: str, pack: Path | None, saes: tuple[tuple[Path, Path | None], ...]
) -> Engine:
    if settings.engine == "vllm":
        from prismgate.engines.vllm import VLLMEngine  # optional: only in the vLLM environment

        return VLLMEngine(
            folder,
            model_id=model_id,
            concept_pack=pack,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_gb=settings.vllm_kv_cache_gb,
            enforce_eager=settings.vllm_enforce_eager,
            tensor_parallel_size=settings.tensor_parallel_size,
            pipeline_parallel_size=settings.pipeline_parallel_size,
            data_parallel_size=settings.data_parallel_size,
            distributed_executor_backend=settings.distributed_executor_backend,
            readout_address=settings.vllm_readout_address,
            block_size=settings.vllm_block_size,
            cache_scope=settings.vllm_cache_scope,
            steering_rounds=settings.vllm_steering_rounds,
            saes=saes,
        )
    from prismgate.engines.hf import TransformersEngine

    return TransformersEngine(
        folder,
        model_id=model_id,
        concept_pack=pack,
        device=settings.device,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        threads=settings.threads,
        prefill_chunk=settings.prefill_chunk,
        max_cached_tokens=settings.max_cached_tokens,
        max_cached_bytes=settings.max_cached_bytes,
        max_batch=settings.max_batch,
        grammar_cache_bytes=settings.grammar_cache_bytes,
        grammar_compile_timeout_s=settings.grammar_compile_timeout_s,
        saes=saes,
    )


def build_service(settings: Settings, engine: Engine | None = None) -> SessionService:
    """A service whose pool is not started yet: call ``await service.pool.start()``.

    One engine per served model and replica (``[[models]]``, the first the default), or ``engine`` alone.
    """
    if engine is not None:
        engines = [engine]
    else:
        engines = [build_engine(served) for served in settings.served() for _ in range(served.replicas)]
    pool = EnginePool(
        engines,
        max_active=settings.max_active,
        max_queued=settings.max_queued,
        reserved_slots=settings.reserved_slots,
        memory_budget_bytes=settings.memory_budget_bytes,
    )
    return SessionService(
        pool,
        build_store(settings),
        build_budget(settings),
        build_quota(settings),
        deterministic=settings.deterministic,
        specials_in_text=settings.allow_special_tokens_in_text,
    )


def build_budget(settings: Settings) -> RequestBudget:
    """The core's request budget, limit for limit from the settings of the same names (the models size the rest)."""
    fields = [f for f in dataclasses.fields(RequestBudget) if not f.metadata.get("derived")]
    return RequestBudget(**{f.name: getattr(settings, f.name) for f in fields})


def build_quota(settings: Settings) -> Quota:
    """Per-key limits counted in this process, or in the session store's Redis so every replica shares them."""
    if settings.session_store == "memory":
        return LocalQuota()
    from prismgate.core.stores.redis_quota import RedisQuota  # optional: needs the redis package

    return RedisQuota(settings.session_store)


def build_store(settings: Settings) -> SessionStore:
    """In this process by default; in Redis when ``session_store`` is a ``redis://`` URL."""
    ttl_s, max_sessions, max_tokens = settings.session_ttl_s, settings.max_sessions, settings.max_session_tokens
    if settings.session_store == "memory":
        return InProcessStore(ttl_s=ttl_s, max_sessions=max_sessions, max_total_tokens=max_tokens)
    from prismgate.core.stores.redis_store import RedisStore  # optional: needs the redis package

    return RedisStore(
        settings.session_store,
        ttl_s=ttl_s,
        max_sessions=max_sessions,
        max_total_tokens=max_tokens,
        lock_s=settings.session_lock_s,
    )
