"""Loading: weights, tokenizer and concept pack in, the engine's :class:`EngineInfo` out."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prismgate.core.engine import EngineInfo, ReadoutManifest
from prismgate.engines.hf import invariance_check, invariant, kv_room, llama_layer, mixed_pass, packing
from prismgate.engines.hf.adapters import ModelAdapter, load_adapter
from prismgate.engines.hf.cpu_dtype import cpu_flags
from prismgate.engines.hf.steering import Steerer
from prismgate.engines.huge_pages import collapse
from prismgate.engines.introspect import decoder_layers
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.readouts.probe import ReadoutProbe
from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import load_for_model
from prismgate.engines.sae.probe import FeatureProbe, feature_manifest
from prismgate.engines.tokenizer import HFTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    adapter: ModelAdapter
    probe: ReadoutProbe | None  # hooks that read the residual stream, when a concept pack is loaded
    steerer: Steerer | None  # hooks that add to it (ahead of the probe's), with the same pack and the SAEs
    info: EngineInfo
    saes: tuple[SaeEncoder, ...] = ()  # sparse autoencoders, one per layer, on the model's device
    features: FeatureProbe | None = None  # hooks that encode the stream with them (after the steerer's)


def load(
    model_path: Path,
    *,
    model_id: str,
    concept_pack: str | Path | None,
    device: str,
    dtype: str,
    max_model_len: int | None,
    saes: Sequence[tuple[Path, Path | None]] = (),
    packed_weights: bool = True,
    huge_pages: bool = True,
) -> LoadedModel:
    """Load on ``device`` ("auto": CUDA when there is one). Slow: call it off the event loop."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    adapter = load_adapter(model_path, device=device, dtype=dtype, flags=cpu_flags())
    choice = adapter.dtype_choice
    model = adapter.model
    packed = packing.pack(model, enabled=packed_weights)  # before the invariant kernels, which wrap the products
    layers = llama_layer.install(model)  # reads the packed products; checked before anything else runs the layers
    probe: ReadoutProbe | None = None
    manifest: ReadoutManifest | None = None
    pack: ConceptPack | None = None
    config = model.config.get_text_config()
    # SAEs are checked before the slower start-up work: a wrong file stops the start at once
    encoders = tuple(
        SaeEncoder(sae, next(model.parameters()).device)
        for sae in load_for_model(saes, len(decoder_layers(model)), int(config.hidden_size))
    )
    if concept_pack is not None:
        pack = ConceptPack.load(concept_pack)
        probe = ReadoutProbe(model, pack)
        manifest = pack.manifest
    # steering hooks go ahead of the readout and feature hooks on every layer (prepended)
    steerer = Steerer(model, pack, probe.project if probe else None, encoders) if pack or encoders else None
    features = FeatureProbe(model, encoders) if encoders else None
    deterministic_off = _invariance(adapter)
    riding = mixed_pass.check(adapter, attention_installed=invariant.installed(model), probe=probe)
    tokenizer = adapter.tokenizer
    # last: what the load allocated is all in place
    pages = collapse(enabled=huge_pages, device=torch.device(adapter.device).type)
    limit = max_model_len or int(getattr(config, "max_position_embeddings", 4096))
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if not eos_ids and tokenizer.eos_token_id is not None:
        eos_ids = (int(tokenizer.eos_token_id),)
    info = EngineInfo(
        model_id=model_id,
        max_model_len=limit,
        vocab_size=int(config.vocab_size),
        eos_token_ids=eos_ids,
        tokenizer=HFTokenizer(tokenizer),
        readouts=manifest,
        vision=adapter.vision_tokens,
        engine_name="transformers",
        steering=steerer is not None,
        steering_gates=steerer is not None,
        steering_features=steerer is not None and bool(encoders),
        deterministic=deterministic_off is None,
        deterministic_off=deterministic_off,
        features=feature_manifest(encoders),
        kv_bytes_per_token=kv_bytes_per_token(config, model.dtype),
        kv_block_tokens=kv_room.ROOM,
        dtype=choice.name if choice else "",
        dtype_reason=choice.reason if choice else "",
        packed_layers=packed.layers,
        packed_reason=packed.reason,
        huge_page_bytes=pages.bytes,
        huge_pages_reason=pages.reason,
        mixed_passes=riding.enabled,
        mixed_passes_reason=riding.reason,
    )
    log.info(
        "loaded %s on %s in %s (%s); weights %s; %s; %s; %s",
        model_id,
        device,
        info.dtype,
        info.dtype_reason,
        packed.reason,
        layers,
        pages.reason,
        riding.reason,
    )
    return LoadedModel(adapter, probe, steerer, info, encoders, features)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token holds in the cache: layers x (keys, values) x kv heads x head size."""
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or (int(config.hidden_size) // heads if heads else 0))
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    return layers * 2 * kv_heads * head_dim * dtype.itemsize


# Measured on an H100 (torch 2.11, cuBLAS): with the kernels installed and the start-up check
# passing, a prompt prefilled in chunks of 3 beside other requests gave readouts whose last bits
# differ from the prompt prefilled alone (tests/engines/test_determinism.py, mix 0). cuBLAS chooses
# its GEMM kernel by the whole shape, attention's products included; invariance there needs kernels
# of fixed reduction order (vLLM's batch-invariant mode has them).
CPU_ONLY = (
    "the transformers engine runs deterministic requests on CPU only (on a GPU its matrix products are "
    "not batch-invariant); on a GPU serve with --engine vllm and VLLM_BATCH_INVARIANT=1"
)


def _invariance(adapter: ModelAdapter) -> str | None:
    """Install the batch-invariant kernels and check them here; None, or why deterministic requests are refused."""
    if adapter.vision_tokens is not None:
        return "the transformers engine runs deterministic requests on text-only models (this one has a vision encoder)"
    if torch.device(adapter.device).type != "cpu":
        return CPU_ONLY
    if not invariant.install(adapter.model):
        return "this model's attention does not run through transformers' SDPA interface, which the kernels replace"
    failure = invariance_check.check(adapter)
    if failure is not None:
        log.warning("deterministic requests are refused on this device: the start-up check failed: %s", failure)
        return f"the start-up check of the batch-invariant kernels failed on this device: {failure}"
    return None
