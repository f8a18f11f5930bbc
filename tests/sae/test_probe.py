"""The feature probe on every architecture: what leaves the hook is the encoder's top-k and watched values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prismgate.core.actions import PositionRange
from prismgate.core.features import FeatureSpec
from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import load_sae
from prismgate.engines.sae.probe import FeatureProbe
from tests.sae.saes import write_sae


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu"])
def test_the_hook_keeps_the_top_features_and_the_watched_ones(tmp_path: Path, tiny_model_dir: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    encoder = SaeEncoder(load_sae(write_sae(tmp_path / arch, arch, layer=1, k=8)))
    probe = FeatureProbe(model, [encoder])
    spec = FeatureSpec(top_k=5, layers=(1,), ids=(3, 200, 17), ranges=(PositionRange(0, 6),))
    tokens = torch.tensor([[1, 17, 42, 99, 7, 3]])
    assert probe.arm([spec])
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states[2][0]
    captured = probe.take()
    acts = encoder.encode(hidden)
    for t in range(6):
        got = captured.features(0, t, spec)
        values, ids = torch.topk(acts[t], 5)
        active = values > 0
        assert got.ids[0].tolist() == ids[active].tolist()
        assert got.values[0].tolist() == pytest.approx(values[active].tolist(), abs=1e-5)
        assert got.watched is not None
        assert got.watched[0].tolist() == pytest.approx(acts[t, [3, 200, 17]].tolist(), abs=1e-5)
    assert not probe.armed  # taken: the next pass computes nothing unless armed again
    probe.remove()
