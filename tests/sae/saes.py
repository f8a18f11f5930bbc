"""SAE folders in SAELens's format with random weights, for the loader's and the encoder's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write_sae(
    folder: Path,
    architecture: str = "topk",
    *,
    d_in: int = 128,
    d_sae: int = 256,
    layer: int = 1,
    k: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cfg: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """One SAE folder; ``cfg`` and ``tensors`` override (a value None removes the entry)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {
        "W_enc": torch.randn(d_in, d_sae, generator=gen) / d_in**0.5,
        "b_enc": torch.randn(d_sae, generator=gen) * 0.1,
        "W_dec": torch.randn(d_sae, d_in, generator=gen) / d_sae**0.5,
        "b_dec": torch.randn(d_in, generator=gen) * 0.1,
    }
    if architecture == "jumprelu":
        weights["threshold"] = torch.rand(d_sae, generator=gen) * 0.2
    weights = {name: w.to(dtype) for name, w in weights.items()}
    config: dict[str, Any] = {
        "architecture": architecture,
        "d_in": d_in,
        "d_sae": d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": {"hook_name": f"blocks.{layer}.hook_resid_post", "model_name": "tiny-llama"},
    }
    if architecture == "topk":
        config["k"] = k
    for key, value in (cfg or {}).items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    for key, value in (tensors or {}).items():
        if value is None:
            weights.pop(key, None)
        else:
            weights[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(config))
    return folder
