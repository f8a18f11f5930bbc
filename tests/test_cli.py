"""The ``prismgate`` command as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from prismgate.settings import Settings

ENV = dict(os.environ, OMP_NUM_THREADS="1", PRISMGATE_THREADS="1")


def prismgate(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prismgate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        cwd=Path(__file__).parent,
    )


def test_serve_help_documents_every_setting() -> None:
    proc = prismgate("serve", "--help", timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for f in Settings.fields():
        assert "--" + f.name.replace("_", "-") in text
        assert "PRISMGATE_" + f.name.upper() in text


def test_serve_help_is_grouped_and_imports_no_model_code() -> None:
    proc = prismgate("serve", "--help", timeout=60)
    sections = [line[:-1] for line in proc.stdout.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    from prismgate.settings.flags import sections as groups

    assert sections == ["options", *(title for title, _ in groups())]
    assert sections[1:4] == [
        "server",
        "HTTP connections (what one client may hold open, and for how long)",
        "security (who may call, and from which pages)",
    ]
    vllm = proc.stdout.split("vLLM engine (--engine vllm only):")[1].split("\ninstruments")[0]
    assert "--vllm-block-size" in vllm and "--tensor-parallel-size" in vllm and "--threads" not in vllm
    # --help parses before anything heavy loads: torch (1.3 s of imports) stays out of the CLI's modules
    check = "import sys, prismgate.cli, prismgate.cli_generate; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=ENV).returncode == 0


def test_bad_flag_values_are_clear_errors() -> None:
    proc = prismgate("serve", "--engine", "tensorflow", timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    proc = prismgate("generate", "hi", "--model", str(tmp_path / "nope"), timeout=60)
    assert proc.returncode == 2
    assert "not a Hugging Face model folder (nothing is there); put or mount one there" in proc.stderr
    # what a container sees when nothing was mounted on its model path (the GPU image's default)
    (tmp_path / "model").mkdir()
    proc = prismgate("generate", "hi", "--model", str(tmp_path / "model"), timeout=60)
    assert proc.returncode == 2
    assert "(the folder is empty (an unfilled mount point?)); put or mount one there" in proc.stderr
    assert f"-v /host/models/NAME:{tmp_path / 'model'}:ro" in proc.stderr


def test_generate_help_lists_only_its_own_flags() -> None:
    proc = prismgate("generate", "--help", timeout=60)
    assert proc.returncode == 0
    for flag in ("--max-tokens", "--readouts", "--layers", "--concepts", "--model", "--concept-pack", "--threads"):
        assert flag in proc.stdout
    for flag in (
        "--http-port",
        "--grpc-port",
        "--auth-token",
        "--max-sessions",
        "--evergreen-max-nodes",
        "--playground",
    ):
        assert flag not in proc.stdout
    from prismgate.cli_generate import SETTINGS

    own = {"--help", "--max-tokens", "--temperature", "--seed", "--raw", "--readouts", "--layers", "--concepts"}
    settings = {"--config", "--no-log-json", *("--" + name.replace("_", "-") for name in SETTINGS)}
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", proc.stdout)) == own | settings
    refused = prismgate("generate", "hi", "--http-port", "1", timeout=60)
    assert refused.returncode == 2 and "unrecognized arguments: --http-port" in refused.stderr


def _generate_table(model_dir: Path, pack: Path, *args: str) -> list[list[str]]:
    """``generate --readouts`` on the tiny model: the table's lines (header included), split on '|'."""
    proc = prismgate(
        "generate", "hello", "--model", str(model_dir), "--concept-pack", str(pack), "--max-tokens", "5",
        "--readouts", *args, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.strip()]


def test_generate_readouts_are_centered_chosen_and_aligned(
    tiny_model_dir: Path, tiny_pack: Path, tmp_path: Path
) -> None:
    from prismgate.engines.readouts.pack import ConceptPack

    base = ConceptPack.load(tiny_pack)
    centers = np.array([[10.0, -20.0, 30.0], [-40.0, 50.0, -60.0]], dtype=np.float32)
    zero, shifted = tmp_path / "zero.safetensors", tmp_path / "centers.safetensors"
    dataclasses.replace(base, centers=np.zeros_like(centers)).save(zero)
    dataclasses.replace(base, centers=centers).save(shifted)
    choice = ("--layers", "1,0", "--concepts", "concept2,concept0")

    raw, centred = _generate_table(tiny_model_dir, zero, *choice), _generate_table(tiny_model_dir, shifted, *choice)
    assert raw[0] == centred[0] == "readouts, value - center:"
    assert "layer 1" in centred[1] and centred[1].index("layer 1") < centred[1].index("layer 0")
    header = centred[2]
    assert header.split("|")[1].split() == ["concept2", "concept0", "concept2", "concept0"]
    rows = [line for line in centred[3:] if "|" in line]
    assert len(rows) == 5 and centred[-1].startswith("answer: ")
    # every value ends in the column its concept's name ends in, and '|' lines up
    name_ends = [m.end() for m in re.finditer(r"concept\d", header)]
    for row in rows:
        assert row.index("|") == header.index("|")
        assert [m.end() for m in re.finditer(r"[+-]\d+\.\d\d", row.split("|")[1])] == [
            end - header.index("|") - 1 for end in name_ends
        ]
    # cells are value - center: the same tokens' values, shifted by exactly the chosen centers
    expected_shift = [centers[1, 2], centers[1, 0], centers[0, 2], centers[0, 0]]
    for r, c in zip([line for line in raw[3:] if "|" in line], rows, strict=True):
        assert r.split("|")[0] == c.split("|")[0]  # same position, token and logprob
        got = np.array(c.split("|")[1].split(), dtype=float)
        want = np.array(r.split("|")[1].split(), dtype=float) - expected_shift
        np.testing.assert_allclose(got, want, atol=0.011)


def test_generate_names_a_missing_layer_or_concept_before_loading_the_model(
    tiny_model_dir: Path, tiny_pack: Path, tmp_path: Path
) -> None:
    # a model folder with a config and no weights: loading it would fail with another message
    hollow = tmp_path / "hollow"
    hollow.mkdir()
    (hollow / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    for flag, value, message in (("--layers", "7", "no layer '7'"), ("--concepts", "vibes", "no concept 'vibes'")):
        proc = prismgate(
            "generate", "hi", "--model", str(hollow), "--concept-pack", str(tiny_pack), "--readouts",
            flag, value, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_json_logs_are_json_lines_only(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Everything `serve --log-json` writes, on stdout and stderr, is one JSON object per line."""
    from tests.docs.server import serve

    with serve(tmp_path, "--model", str(tiny_model_dir), "--concept-pack", "none") as served:
        body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3}
        assert httpx.post(served.http_url + "/v1/completions", json=body, timeout=60).status_code == 200
    lines = served.log_lines()
    assert any('"ready: ' in line for line in lines) and any('"stopped"' in line for line in lines)
    for line in lines:
        assert isinstance(json.loads(line), dict), line


@pytest.mark.slow
def test_generate_answers_from_the_shell_with_the_default_model() -> None:
    proc = prismgate("generate", "What is the capital of France?", "--max-tokens", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
