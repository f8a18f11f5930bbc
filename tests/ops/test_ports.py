"""Ports are exclusive: a second server on a port in use fails at once, with one line naming the port and the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prismgate.server import CannotListen
from tests.conftest import run_server, tiny_settings


@pytest.mark.parametrize(("taken", "flag"), [("http_port", "--http-port"), ("grpc_port", "--grpc-port")])
def test_a_second_server_on_a_port_in_use_fails(
    live_server: Any, tiny_model_dir: Path, tiny_pack: Path, taken: str, flag: str
) -> None:
    port = live_server.gateway.http_port if taken == "http_port" else live_server.gateway.grpc_port
    settings = tiny_settings(tiny_model_dir, tiny_pack, **{taken: port})
    with pytest.raises(CannotListen) as refused, run_server(settings):
        pass
    assert f"127.0.0.1:{port}" in str(refused.value) and flag in str(refused.value)


def test_the_command_says_so_in_one_line(live_server: Any, tiny_model_dir: Path) -> None:
    port = live_server.gateway.grpc_port
    command = [
        str(Path(sys.executable).parent / "prismgate"), "serve", "--model", str(tiny_model_dir),
        "--concept-pack", "none", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if "cannot listen" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--grpc-port" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
