"""The loader and the encoder against SAELens itself (``sae-lens``, a dev dependency), on the same weights.

Features (which ids are active) and activations must agree to 1e-4 in float32, for every
architecture, on random inputs and on the embedded model's own residual stream with its
shipped SAE.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import load_sae
from prismgate.instruments.sae.auto import SHIPPED, sae_folders
from tests.sae.saes import write_sae

sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is a dev dependency: make setup installs it")
TOLERANCE = 1e-4


def reference(folder: Path) -> object:
    return sae_lens.SAE.load_from_disk(str(folder), device="cpu", dtype="float32")


def compare(folder: Path, x: torch.Tensor) -> tuple[float, float]:
    """Largest activation difference and largest reconstruction difference between SAELens and us."""
    ours = SaeEncoder(load_sae(folder))
    ref = reference(folder)
    with torch.no_grad():
        theirs = ref.encode(x)  # type: ignore[attr-defined]
        mine = ours.encode(x)
        assert torch.equal(theirs > 0, mine > 0), "the active features differ"
        recon = (ref.decode(theirs) - ours.decode(mine)).abs().max()  # type: ignore[attr-defined]
    return float((theirs - mine).abs().max()), float(recon)


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu"])
def test_every_architecture_matches_sae_lens(tmp_path: Path, arch: str) -> None:
    folder = write_sae(tmp_path / arch, arch, d_in=96, d_sae=512, k=16)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 3
    acts, recon = compare(folder, x)
    assert acts <= TOLERANCE and recon <= TOLERANCE


def test_apply_b_dec_to_input_false_matches_sae_lens(tmp_path: Path) -> None:
    folder = write_sae(tmp_path / "nb", "standard", cfg={"apply_b_dec_to_input": False})
    acts, _ = compare(folder, torch.randn(8, 128, generator=torch.Generator().manual_seed(4)))
    assert acts <= TOLERANCE


@pytest.mark.slow
def test_the_shipped_sae_matches_sae_lens_on_the_models_own_stream(tmp_path: Path) -> None:
    from prismgate.engines.models import resolve_model
    from prismgate.instruments.packs.capture import load_model
    from prismgate.instruments.sae.train import LayerTap

    folder = sae_folders(SHIPPED)[0]
    sae = load_sae(folder)
    model, tokenizer = load_model(resolve_model(None)[0])
    tap = LayerTap(model, sae.layer)
    text = "Le chat dort sur le canapé. What is the capital of France? def add(a, b): return a + b"
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokenizer(text)["input_ids"]]))
    tap.remove()
    assert tap.captured is not None
    stream = tap.captured[0, 1:].float().clone()  # position 0, the attention sink, is not what it was trained on
    acts, recon = compare(folder, stream)
    assert acts <= TOLERANCE and recon <= TOLERANCE
