"""``make setup`` picks the torch build for the machine: CUDA with an NVIDIA GPU, else the CPU build.

The recipe runs for real, with the virtualenv's ``python`` and ``pip`` replaced by scripts that
record their arguments, so the test sees which index each machine would install torch from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _setup(tmp_path: Path, *, gpu: bool, index_reachable: bool) -> list[str]:
    """Run ``make setup`` against a fake virtualenv; the pip command lines it ran."""
    venv, tools, log = tmp_path / "venv", tmp_path / "tools", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    _script(venv / "bin" / "pip", f'echo "$*" >> {log}\n')
    _script(venv / "bin" / "python", "exit 0\n" if index_reachable else "exit 1\n")  # `python -c urlopen(...)`
    if gpu:
        _script(tools / "nvidia-smi", "exit 0\n")
    os.symlink(shutil.which("touch") or "/usr/bin/touch", tools / "touch")
    # PATH holds only these tools, so a real nvidia-smi on the test machine cannot answer
    env = {"PATH": str(tools), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [MAKE, "-C", str(ROOT), "-B", "setup", f"VENV={venv}"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (venv / ".prismgate-installed").exists()
    return [line for line in log.read_text().splitlines() if "torch" in line]


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
def test_a_gpu_machine_gets_pypi_torch(tmp_path: Path) -> None:
    assert _setup(tmp_path, gpu=True, index_reachable=True) == ["install -q torch==2.13.0"]


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
def test_a_machine_without_gpu_gets_the_cpu_build(tmp_path: Path) -> None:
    assert _setup(tmp_path, gpu=False, index_reachable=True) == [f"install -q --index-url {CPU_INDEX} torch==2.13.0"]


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
def test_without_the_cpu_index_the_plain_pin_is_installed(tmp_path: Path) -> None:
    assert _setup(tmp_path, gpu=False, index_reachable=False) == ["install -q torch==2.13.0"]
