"""Loading SAEs in SAELens's format: every architecture, and every refusal naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from prismgate.core.errors import GatewayError
from prismgate.engines.sae.encode import SaeEncoder
from prismgate.engines.sae.files import load_for_model, load_sae
from tests.sae.saes import write_sae


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu"])
def test_each_architecture_loads_and_encodes_by_its_rule(tmp_path: Path, arch: str) -> None:
    sae = load_sae(write_sae(tmp_path / arch, arch))
    assert (sae.architecture, sae.layer, sae.d_in, sae.d_sae) == (arch, 1, 128, 256)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    enc = SaeEncoder(sae)
    pre = (x - torch.from_numpy(sae.b_dec)) @ torch.from_numpy(sae.W_enc) + torch.from_numpy(sae.b_enc)
    acts = enc.encode(x)
    if arch == "topk":
        assert int((acts > 0).sum(-1).max()) <= 8
        kept = torch.topk(pre, 8, dim=-1).values.relu()
        assert torch.allclose(torch.sort(acts, dim=-1, descending=True).values[:, :8], kept, atol=1e-5)
    elif arch == "jumprelu":
        expect = torch.where(pre > torch.from_numpy(sae.threshold), pre.relu(), torch.zeros_like(pre))
        assert torch.allclose(acts, expect, atol=1e-5)
    else:
        assert torch.allclose(acts, pre.relu(), atol=1e-5)
    ids, values = enc.top(x, 4)
    assert torch.equal(torch.gather(acts, -1, ids), values)
    assert torch.all(values[:, :-1] >= values[:, 1:])


def test_resid_pre_reads_after_the_layer_before(tmp_path: Path) -> None:
    sae = load_sae(write_sae(tmp_path / "s", cfg={"metadata": {"hook_name": "blocks.2.hook_resid_pre"}}))
    assert sae.layer == 1


def test_a_pre_6_config_reads_as_sae_lens_reads_it(tmp_path: Path) -> None:
    folder = write_sae(
        tmp_path / "old",
        cfg={
            "architecture": None,
            "metadata": None,
            "k": None,
            "hook_point": "blocks.0.hook_resid_post",
            "activation_fn_str": "topk",
            "activation_fn_kwargs": {"k": 4},
        },
    )
    sae = load_sae(folder)
    assert (sae.architecture, sae.k, sae.layer) == ("topk", 4, 0)


def test_bfloat16_and_float16_weights_load_as_float32(tmp_path: Path) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        sae = load_sae(write_sae(tmp_path / str(dtype), dtype=dtype))
        assert sae.W_enc.dtype == np.float32


def test_labels_from_the_folder_or_a_file(tmp_path: Path) -> None:
    folder = write_sae(tmp_path / "s")
    (folder / "labels.json").write_text(json.dumps({"3": "French", "7": "code"}))
    assert load_sae(folder).label(3) == "French"
    assert load_sae(folder).labels_from == "labels.json in the SAE's folder"
    other = tmp_path / "np.json"
    other.write_text(json.dumps([{"index": "5", "description": "questions"}]))
    sae = load_sae(folder, other)
    assert sae.labels == {5: "questions"} and sae.labels_from == "the labels file np.json"
    assert load_sae(write_sae(tmp_path / "bare")).labels_from == ""


def refused(folder: Path, labels: Path | None = None) -> str:
    with pytest.raises(GatewayError) as info:
        load_sae(folder, labels)
    return info.value.message


@pytest.mark.parametrize(
    ("cfg", "tensors", "words"),
    [
        ({}, {"W_enc": torch.zeros(128, 255)}, ["sae_weights.safetensors", "W_enc", "[128, 255]", "[128, 256]"]),
        ({}, {"b_dec": torch.zeros(64)}, ["sae_weights.safetensors", "b_dec", "[64]"]),
        ({}, {"W_dec": torch.zeros(256, 128, dtype=torch.int32)}, ["sae_weights.safetensors", "W_dec", "I32"]),
        ({}, {"b_enc": None}, ["sae_weights.safetensors", "b_enc", "missing"]),
        ({"dtype": "int8"}, {}, ["cfg.json", "dtype", "int8"]),
        ({"metadata": {"hook_name": "blocks.1.attn.hook_z"}}, {}, ["cfg.json", "hook_name", "hook_z"]),
        ({"metadata": {"hook_name": "blocks.0.hook_resid_pre"}}, {}, ["cfg.json", "hook_name", "embeddings"]),
        ({"metadata": {}}, {}, ["cfg.json", "hook_name", "missing"]),
        ({"architecture": "gated"}, {}, ["cfg.json", "architecture", "gated"]),
        ({"k": 0}, {}, ["cfg.json", "k must be a positive integer"]),
        ({"k": 300}, {}, ["cfg.json", "k 300", "d_sae 256"]),
        ({"d_in": "128"}, {}, ["cfg.json", "d_in"]),
        ({"normalize_activations": "layer_norm"}, {}, ["cfg.json", "normalize_activations"]),
    ],
)
def test_a_wrong_field_is_refused_naming_the_file_and_the_field(
    tmp_path: Path, cfg: dict[str, object], tensors: dict[str, torch.Tensor | None], words: list[str]
) -> None:
    message = refused(write_sae(tmp_path / "bad", cfg=cfg, tensors=tensors))
    for word in words:
        assert word in message, (word, message)


def test_jumprelu_without_a_threshold_is_refused(tmp_path: Path) -> None:
    message = refused(write_sae(tmp_path / "j", "jumprelu", tensors={"threshold": None}))
    assert "threshold" in message and "missing" in message


def test_missing_files_and_bad_labels_are_refused(tmp_path: Path) -> None:
    assert "does not exist" in refused(tmp_path / "nowhere")
    folder = write_sae(tmp_path / "s")
    (folder / "cfg.json").unlink()
    assert "cfg.json: missing" in refused(folder)
    folder = write_sae(tmp_path / "t")
    (folder / "cfg.json").write_text("{not json")
    assert "cfg.json: not readable JSON" in refused(folder)
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"999": "far"}))
    assert "feature id 999 is outside 0-255" in refused(write_sae(tmp_path / "u"), labels)
    labels.write_text(json.dumps({"x": "y"}))
    assert "not an integer" in refused(tmp_path / "u", labels)


def test_the_model_must_fit(tmp_path: Path) -> None:
    a = write_sae(tmp_path / "a", layer=1)
    with pytest.raises(GatewayError, match=r"a/cfg.json: d_in is 128, but the model's hidden size is 64"):
        load_for_model([(a, None)], n_layers=3, hidden_size=64)
    with pytest.raises(GatewayError, match=r"reads after layer 1, but the model has layers 0-0"):
        load_for_model([(a, None)], n_layers=1, hidden_size=128)
    b = write_sae(tmp_path / "b", layer=1, seed=2)
    with pytest.raises(GatewayError, match=r"b/cfg.json: hook_name reads after layer 1, as .*a/cfg.json does"):
        load_for_model([(a, None), (b, None)], n_layers=3, hidden_size=128)
    c = write_sae(tmp_path / "c", layer=0)
    assert [s.layer for s in load_for_model([(a, None), (c, None)], n_layers=3, hidden_size=128)] == [0, 1]
