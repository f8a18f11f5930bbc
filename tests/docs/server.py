"""``prismgate serve`` as a user starts it: a real process on free ports, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

PRISMGATE = str(Path(sys.executable).parent / "prismgate")
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Served:
    process: subprocess.Popen[str]
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()


@contextlib.contextmanager
def serve(folder: Path, *args: str, timeout: float = 180) -> Iterator[Served]:
    """Serve with ``args`` (plus free ports, one thread, JSON logs) until the block ends."""
    port_file, log_path = folder / "ports.json", folder / "server.log"
    command = [
        PRISMGATE, "serve", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
        "--threads", "1", "--port-file", str(port_file), "--log-json", *args,
    ]  # fmt: skip
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, text=True)
    try:
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server never wrote its port file"
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        served = Served(process, ports["http_port"], ports["grpc_port"], log_path)
        while httpx.get(served.http_url + "/readyz", timeout=5).status_code != 200:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.1)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
