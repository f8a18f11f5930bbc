"""Wiring: settings -> engines (one per served model) -> pool -> session store -> the core service."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prismgate.core.budget import RequestBudget
from prismgate.core.engine import Engine
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
from prismgate.engines.prepare import ConvertStep, PreparedEngine
from prismgate.engines.readouts.pack import DEFAULT_PACKS
from prismgate.settings import Settings

DEFAULT_PACK = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"


def builds_pack(settings: Settings, served_default: bool) -> bool:
    """Whether the pack is built for the served model (``auto``): asked for, or no shipped pack fits."""
    choice = (settings.instruments.concept_pack or "").lower()
    return choice == "auto" or (not choice and not (served_default and DEFAULT_PACK.exists()))


def concept_pack_for(settings: Settings, served_default: bool) -> Path | None:
    """The pack file the engine loads; for ``auto``, the cache file (which may not be built yet)."""
    if builds_pack(settings, served_default):
        from prismgate.instruments.packs.auto import cached_pack_path  # the pack's cache names its recipe

        folder, _ = resolve_model(settings.engine.model)
        return cached_pack_path(
            settings.instruments.concept_pack_cache,
            folder,
            pairs=settings.instruments.concept_pack_pairs,
            dtype=settings.engine.dtype,
        )
    if settings.instruments.concept_pack is not None:
        return None if settings.instruments.concept_pack.lower() == "none" else Path(settings.instruments.concept_pack)
    return DEFAULT_PACK


def sae_specs(settings: Settings, folder: Path, served_default: bool) -> tuple[tuple[Path, Path | None], ...]:
    """(SAE folder, labels file or None) for each SAE the engine loads: ``sae``'s folders, or ``auto``'s."""
    if not settings.instruments.sae:
        return ()
    items = [x.strip() for x in settings.instruments.sae.split(",") if x.strip()]
    labels = [x.strip() for x in (settings.instruments.sae_labels or "").split(",")]
    folders: list[Path] = []
    for item in items:
        if item.lower() == "auto":
            from prismgate.instruments.sae.auto import auto_saes  # the SAE's cache names its training recipe

            folders += auto_saes(settings.instruments.sae_cache, folder, served_default, settings.engine.dtype)
        else:
            folders.append(Path(item).expanduser())
    return tuple(
        (f, Path(labels[i]).expanduser() if i < len(labels) and labels[i] else None) for i, f in enumerate(folders)
    )


def build_engine(settings: Settings) -> Engine:
    if not settings.engine.model and not builds_pack(settings, served_default=True) and not default_model_converted():
        # the first start: the GGUF conversion runs in the engine's start, after the ports are logged
        pack = concept_pack_for(settings, served_default=True)
        model_id = settings.engine.model_name or DEFAULT_MODEL_ID
        saes = sae_specs(settings, default_model_target(), served_default=True)
        return PreparedEngine(
            lambda built: _serving_engine(settings, default_model_target(), model_id, built, saes),
            [ConvertStep(default_model_path, model_id=model_id)],
            model_id=model_id,
            pack=pack,
        )
    folder, name = resolve_model(settings.engine.model)
    model_id = settings.engine.model_name or name
    served_default = name == DEFAULT_MODEL_ID and not settings.engine.model
    pack = concept_pack_for(settings, served_default=served_default)
    saes = sae_specs(settings, folder, served_default)
    if pack is not None and builds_pack(settings, served_default):
        from prismgate.instruments.packs.auto import pack_step  # the build is an instrument, composed here

        step = pack_step(
            folder,
            pack,
            model_id=model_id,
            pairs=settings.instruments.concept_pack_pairs,
            dtype=settings.engine.dtype,
            device=settings.transformers.device,
            threads=settings.transformers.threads or 1,  # one thread unless told: a busy machine's build slows
        )
        return PreparedEngine(
            lambda built: _serving_engine(settings, folder, model_id, built, saes), [step], model_id=model_id, pack=None
        )
    return _serving_engine(settings, folder, model_id, pack, saes)


def _serving_engine(
    settings: Settings, folder: Path, model_id: str, pack: Path | None, saes: tuple[tuple[Path, Path | None], ...]
) -> Engine:
    if settings.engine.engine == "vllm":
        from prismgate.engines.vllm import VLLMEngine  # optional: only in the vLLM environment

        return VLLMEngine(
            folder,
            model_id=model_id,
            concept_pack=pack,
            dtype=settings.engine.dtype,
            max_model_len=settings.engine.max_model_len,
            huge_pages=settings.engine.huge_pages,
            saes=saes,
            **settings.vllm.engine_kwargs(),
        )
    from prismgate.engines.hf import TransformersEngine

    return TransformersEngine(
        folder,
        model_id=model_id,
        concept_pack=pack,
        dtype=settings.engine.dtype,
        max_model_len=settings.engine.max_model_len,
        huge_pages=settings.engine.huge_pages,
        saes=saes,
        **settings.transformers.engine_kwargs(),
    )


def build_pool(settings: Settings, engines: list[Engine]) -> EnginePool:
    """The pool of ``engines`` under the admission settings (slots, queue, reserve, preemption, memory)."""
    return EnginePool(
        engines,
        max_active=settings.admission.max_active,
        max_queued=settings.admission.max_queued,
        reserved_slots=settings.admission.reserved_slots,
        preemption=settings.admission.preemption,
        memory_budget_bytes=settings.admission.memory_budget_bytes,
    )


def build_service(settings: Settings, engine: Engine | None = None) -> SessionService:
    """A service whose pool is not started yet: call ``await service.pool.start()``.

    One engine per served model and replica (``[[models]]``, the first the default), or ``engine`` alone.
    """
    if engine is not None:
        engines = [engine]
    else:
        engines = [build_engine(served) for served in settings.served() for _ in range(served.transformers.replicas)]
    return SessionService(
        build_pool(settings, engines),
        build_store(settings),
        build_budget(settings),
        build_quota(settings),
        deterministic=settings.engine.deterministic,
        specials_in_text=settings.security.allow_special_tokens_in_text,
    )


def build_budget(settings: Settings) -> RequestBudget:
    """The core's request budget, limit for limit from the settings of the same names (the models size the rest)."""
    fields = [f for f in dataclasses.fields(RequestBudget) if not f.metadata.get("derived")]
    return RequestBudget(**{f.name: getattr(settings.budget, f.name) for f in fields})


def build_quota(settings: Settings) -> Quota:
    """Per-key limits counted in this process, or in the session store's Redis so every replica shares them."""
    if settings.sessions.store == "memory":
        return LocalQuota()
    from prismgate.core.stores.redis_quota import RedisQuota  # optional: needs the redis package

    return RedisQuota(settings.sessions.store)


def build_store(settings: Settings) -> SessionStore:
    """In this process by default; in Redis when ``session_store`` is a ``redis://`` URL."""
    sessions = settings.sessions
    ttl_s, max_sessions, max_tokens = sessions.ttl_s, sessions.max_sessions, sessions.max_session_tokens
    if settings.sessions.store == "memory":
        return InProcessStore(ttl_s=ttl_s, max_sessions=max_sessions, max_total_tokens=max_tokens)
    from prismgate.core.stores.redis_store import RedisStore  # optional: needs the redis package

    return RedisStore(
        settings.sessions.store,
        ttl_s=ttl_s,
        max_sessions=max_sessions,
        max_total_tokens=max_tokens,
        lock_s=settings.sessions.lock_s,
    )
