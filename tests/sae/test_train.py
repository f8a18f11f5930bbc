"""``prismgate sae train`` end to end on the tiny model: files SAELens reads, a report, the cache by digest."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from prismgate.engines.sae.auto import auto_saes
from prismgate.engines.sae.files import load_sae
from tests.serve_process import ENV, PRISMGATE


def train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PRISMGATE, "sae", "train", "--features", "256", "--k", "8", "--epochs", "1", "--threads", "1", *args],
        env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_train_writes_a_loadable_sae_reports_its_quality_and_caches_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    cache, report = tmp_path / "cache", tmp_path / "report.json"
    run = train("--model", str(tiny_model_dir), "--layer", "1", "--sae-cache", str(cache), "--report-json", str(report))
    assert run.returncode == 0, run.stderr
    (folder,) = auto_saes(cache, tiny_model_dir, served_default=False, dtype="auto")
    assert folder.name == "layer1" and folder.parent.parent == cache
    sae = load_sae(folder)
    assert (sae.architecture, sae.k, sae.layer, sae.d_in, sae.d_sae) == ("topk", 8, 1, 128, 256)
    numbers = json.loads(report.read_text())
    assert numbers == json.loads((folder / "cfg.json").read_text())["metadata"]["quality"] | {
        k: numbers[k] for k in ("load_s", "capture_s", "train_s", "evaluate_s")
    }
    assert 0 < numbers["fve"] <= 1 and 0 < numbers["l0"] <= 8 and 0 <= numbers["dead"] <= 256
    assert numbers["loss_clean"] <= numbers["loss_spliced"] and numbers["train_tokens"] > 10_000
    assert "fraction of variance explained" in run.stdout and "dead features" in run.stdout
    again = train("--model", str(tiny_model_dir), "--layer", "1", "--sae-cache", str(cache))
    assert again.returncode == 0 and "already trained" in again.stderr
    other = train("--model", str(tiny_model_dir), "--layer", "1", "--sae-cache", str(cache), "--k", "4")
    assert other.returncode == 2 and "holds an SAE trained with" in other.stderr and "--force" in other.stderr


def test_bad_arguments_are_one_line(tiny_model_dir: Path) -> None:
    run = train("--model", str(tiny_model_dir), "--layer", "9")
    assert run.returncode == 2 and run.stderr.strip().endswith("--layer 9: the model has layers 0-2")
    run = train("--k", "300")
    assert run.returncode == 2 and "--k (300) must not exceed --features (256)" in run.stderr
