"""``prismgate serve`` as a user starts it: the real command in a process of its own, on free ports.

One starter for every suite that needs the real process (ops, docs, scale): it waits for the
port file the server writes once it listens, then for ``/readyz``, and stops the server when
the block ends (SIGKILL by default; SIGTERM for tests that read what a clean stop logs).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PRISMGATE = str(Path(sys.executable).parent / "prismgate")
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Served:
    process: subprocess.Popen[str]
    http_url: str
    grpc_target: str
    port_file: Path
    log_path: Path

    @property
    def http_port(self) -> int:
        return int(self.http_url.rsplit(":", 1)[1])

    @property
    def grpc_port(self) -> int:
        return int(self.grpc_target.rsplit(":", 1)[1])

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()

    def logs(self) -> list[dict[str, Any]]:
        """The server's output, one JSON object per line (--log-json)."""
        return [json.loads(line) for line in self.log_lines() if line.startswith("{")]


@contextlib.contextmanager
def serve_process(
    folder: Path,
    *args: str,
    timeout: float = 180.0,
    stop: signal.Signals = signal.SIGKILL,
    fd_limit: int | None = None,
) -> Iterator[Served]:
    """Serve with ``args`` (plus free loopback ports, one thread, JSON logs) until the block ends.

    ``fd_limit``: the process's RLIMIT_NOFILE.
    """
    port_file, log_path = folder / "ports.json", folder / "server.log"
    command = [
        PRISMGATE, "serve", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
        "--threads", "1", "--port-file", str(port_file), "--log-json", *args,
    ]  # fmt: skip
    limit = None if fd_limit is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit)))
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, text=True, preexec_fn=limit
        )
    try:
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server never wrote its port file"
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        assert ports["pid"] == process.pid
        served = Served(
            process, f"http://127.0.0.1:{ports['http_port']}", f"127.0.0.1:{ports['grpc_port']}", port_file, log_path
        )
        while httpx.get(served.http_url + "/readyz", timeout=5).status_code != 200:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server never became ready:\n" + log_path.read_text()
            time.sleep(0.1)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(stop)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
