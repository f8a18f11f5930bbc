"""A configuration mistake stops ``prismgate serve`` at once: one line naming the setting and its source, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {k: v for k, v in os.environ.items() if not k.startswith("PRISMGATE_")} | {"OMP_NUM_THREADS": "1"}


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prismgate", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV | (env or {}),
    )


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ("--http-port", "99999"),
            {},
            "http_port (flag --http-port): 99999 is not valid: expected int <= 65535",
        ),
        (
            (),
            {"PRISMGATE_WORKERS": "0"},
            "workers (environment variable PRISMGATE_WORKERS): 0 is not valid: expected int >= 1",
        ),
        (
            ("--engine", "vllm"),
            {"PRISMGATE_REPLICAS": "2"},
            "replicas (environment variable PRISMGATE_REPLICAS): must be 1 with the vLLM engine, which has its own "
            "(data_parallel_size)",
        ),
    ],
)
def test_flag_and_environment_mistakes(args: tuple[str, ...], env: dict[str, str], line: str) -> None:
    proc = serve(*args, env=env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"prismgate: error: {line}"]  # one line: no usage, no traceback
    assert proc.stdout == ""


def test_file_mistakes_name_the_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text('[prismgate]\nhttp_port = 8080\nsession-store = "postgres://db"\n')
    proc = serve("--config", str(cfg))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"prismgate: error: session_store (config file {cfg}, key session-store): must be 'memory' or a redis:// URL, "
        "got 'postgres://db'"
    ]
    cfg.write_text('[[models]]\nname = "a"\n[[models]]\nname = "b"\ndtype = "float64"\n')
    proc = serve(env={"PRISMGATE_CONFIG": str(cfg)})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"prismgate: error: dtype (config file {cfg}, [[models]] #2, key dtype): 'float64' is not one of auto, "
        "bfloat16, float16, float32"
    ]
