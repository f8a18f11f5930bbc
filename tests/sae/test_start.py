"""SAEs from the settings (and ``[[models]]``) to the engine, and a wrong one refused at start."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from prismgate.compose import sae_specs
from prismgate.core.errors import GatewayError
from prismgate.engines.hf import TransformersEngine
from prismgate.settings import ConfigError, Settings
from tests.sae.saes import write_sae
from tests.serve_process import ENV, PRISMGATE

pytestmark = pytest.mark.slow


def test_models_entries_carry_their_own_saes_and_labels(tmp_path: Path, tiny_model_dir: Path) -> None:
    a, b = write_sae(tmp_path / "a", layer=0), write_sae(tmp_path / "b", layer=2)
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({"1": "one"}))
    config = tmp_path / "prismgate.toml"
    config.write_text(
        f'[[models]]\nname = "with"\nmodel = "{tiny_model_dir}"\nsae = "{a},{b}"\nsae_labels = ",{labels}"\n'
        f'[[models]]\nname = "without"\nmodel = "{tiny_model_dir}"\n'
    )
    with_sae, without = Settings.load(env={}, config_file=str(config)).served()
    assert sae_specs(with_sae, tiny_model_dir, served_default=False) == ((a, None), (b, labels))
    assert sae_specs(without, tiny_model_dir, served_default=False) == ()


def test_settings_mistakes_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="give sae too"):
        Settings.load({"sae_labels": "x.json"}, env={})
    assert Settings.load({"sae": "x", "engine": "vllm"}, env={}).instruments.sae == "x"  # both engines read SAEs
    with pytest.raises(ConfigError, match=r"^sae_labels \(flag --sae-labels\): names 2 files for 1 SAEs in sae$"):
        Settings.load({"sae": "a", "sae_labels": "x.json,y.json"}, env={})
    with pytest.raises(ConfigError, match=r"^sae_labels \(flag --sae-labels\): cannot be matched to sae = 'auto'"):
        Settings.load({"sae": "auto", "sae_labels": "x.json"}, env={})
    config = tmp_path / "prismgate.toml"
    config.write_text('[[models]]\nname = "m"\nsae = "a"\nsae_labels = "x.json,y.json"\n')
    with pytest.raises(ConfigError, match=r"^sae_labels \(config file .*, \[\[models\]\] #1\): names 2 files"):
        Settings.load(env={}, config_file=str(config))


def test_auto_for_another_model_says_how_to_train_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = Settings.load({"sae": "auto", "sae_cache": str(tmp_path / "cache")}, env={})
    with pytest.raises(GatewayError, match=r"no SAE trained for the model .* run 'prismgate sae train --model"):
        sae_specs(settings, tiny_model_dir, served_default=False)


async def test_the_engine_loads_its_saes_on_its_layers(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = TransformersEngine(
        tiny_model_dir,
        threads=1,
        saes=((write_sae(tmp_path / "a", layer=2), None), (write_sae(tmp_path / "b", layer=0, k=4), None)),
    )
    await engine.start()
    try:
        assert [(e.layer, e.sae.k, str(e.W_enc.device)) for e in engine.saes] == [(0, 4, "cpu"), (2, 8, "cpu")]
    finally:
        await engine.close()


async def test_the_engine_refuses_an_sae_of_another_width(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = TransformersEngine(tiny_model_dir, threads=1, saes=((write_sae(tmp_path / "w", d_in=64), None),))
    with pytest.raises(GatewayError, match=r"w/cfg.json: d_in is 64, but the model's hidden size is 128"):
        await engine.start()
    assert "d_in is 64" in engine.health().reason


def test_serve_stops_at_start_naming_the_file_and_the_field(
    tmp_path: Path, tiny_model_dir: Path, tiny_pack: Path
) -> None:
    bad = write_sae(tmp_path / "bad", layer=7)
    process = subprocess.run(
        [PRISMGATE, "serve", "--model", str(tiny_model_dir), "--concept-pack", str(tiny_pack), "--sae", str(bad),
         "--http-port", "0", "--grpc-port", "0", "--threads", "1"],
        env={**os.environ, **ENV}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert process.returncode == 1
    assert f"{bad}/cfg.json: hook 'blocks.7.hook_resid_post' reads after layer 7" in process.stderr
