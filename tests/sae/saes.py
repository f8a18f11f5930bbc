"""SAE folders in SAELens's format with random weights, for the loader's and the encoder's tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
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


def labelled_pair(root: Path) -> list[Path]:
    """The servers' SAEs: two random TopK SAEs (k 6) after layers 0 and 1, labels on the even ids of the first."""
    a = write_sae(root / "a", layer=0, k=6, seed=5)
    (a / "labels.json").write_text(json.dumps({str(i): f"feature {i}" for i in range(0, 256, 2)}))
    return [a, write_sae(root / "b", layer=1, k=6, seed=6)]


def streamed_features(url: str, payload: dict[str, Any], timeout: float = 60) -> list[Any]:
    """The features every chunk of a streamed completion carries, in order."""
    streamed: list[Any] = []
    with httpx.stream("POST", url + "/v1/completions", json={**payload, "stream": True}, timeout=timeout) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice and "prismgate" in choice[0]:
                    streamed += choice[0]["prismgate"]["features"]
    return streamed


def assert_same_features(a: list[Any], b: list[Any], tol: float = 1e-4) -> None:
    """Two runs' per-token features on the OpenAI wire: the same positions, ids in order, activations within ``tol``."""
    import pytest

    assert [t["position"] for t in a] == [t["position"] for t in b]
    for x, y in zip(a, b, strict=True):
        for la, lb in zip(x["layers"], y["layers"], strict=True):
            assert [f["id"] for f in la["top"]] == [f["id"] for f in lb["top"]]
            assert [f["activation"] for f in la["top"]] == pytest.approx([f["activation"] for f in lb["top"]], abs=tol)
            assert la.get("watched") == pytest.approx(lb.get("watched"), abs=tol)
