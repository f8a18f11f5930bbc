"""The ``prismgate`` command as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_bad_flag_values_are_clear_errors() -> None:
    proc = prismgate("serve", "--engine", "tensorflow", timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    proc = prismgate("generate", "hi", "--model", str(tmp_path / "nope"), timeout=60)
    assert proc.returncode == 2
    assert "not a Hugging Face model folder" in proc.stderr


def test_generate_with_the_tiny_model_streams_tokens(tiny_model_dir: Path, tiny_pack: Path) -> None:
    proc = prismgate(
        "generate",
        "hello",
        "--model",
        str(tiny_model_dir),
        "--concept-pack",
        str(tiny_pack),
        "--max-tokens",
        "5",
        "--readouts",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "|" in line]
    assert len(lines) == 5  # one readout line per generated token
    assert all(len(line.split("|")[1].split()) == 3 for line in lines)  # three concepts


@pytest.mark.slow
def test_generate_answers_from_the_shell_with_the_default_model() -> None:
    proc = prismgate("generate", "What is the capital of France?", "--max-tokens", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
