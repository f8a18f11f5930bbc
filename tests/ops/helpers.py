"""Small helpers for the ops tests: scrape a live server, drive the core on its loop."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.events import Done, TokenEvent


def scrape(http_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics over HTTP and parse it with Prometheus's own text parser: {(sample name, labels): value}."""
    response = httpx.get(f"{http_url}/metrics", timeout=10)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def action(
    tokens: list[int], *, max_tokens: int = 8, origin: str = "ops-test", readouts: bool = False, **spec: Any
) -> GenerateAction:
    ranges = (PositionRange(0, len(tokens) + max_tokens),) if readouts else ()
    return GenerateAction(
        append_tokens=tuple(tokens),
        spec=GenerateSpec(max_tokens=max_tokens, readout_ranges=ranges, **spec),
        origin=origin,
    )


async def collect(stream: Any) -> tuple[list[TokenEvent], Done]:
    events: list[TokenEvent] = []
    async for event in stream:
        if isinstance(event, Done):
            return events, event
        events.append(event)
    raise AssertionError("stream ended without Done")


# -- the real command in a process of its own -----------------------------------------------------


@dataclass
class Served:
    process: subprocess.Popen[str]
    http_url: str
    grpc_target: str
    port_file: Path
    log_path: Path

    def logs(self) -> list[dict[str, Any]]:
        """The server's stderr, one JSON object per line (--log-json); progress bars are not log lines."""
        out = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out


def _limit_descriptors(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


@contextlib.contextmanager
def serve(tmp_path: Path, model_dir: Path, *args: str, fd_limit: int | None = None) -> Iterator[Served]:
    """``prismgate serve`` on the tiny model in a process of its own (``fd_limit``: its RLIMIT_NOFILE)."""
    port_file = tmp_path / "ports.json"
    log_path = tmp_path / "server.log"
    command = [
        str(Path(sys.executable).parent / "prismgate"), "serve",
        "--model", str(model_dir), "--model-name", "tiny-llama", "--concept-pack", "none", "--threads", "1",
        "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
        "--port-file", str(port_file), "--log-json", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            preexec_fn=None
            if fd_limit is None
            else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit)),
        )
    try:
        deadline = time.monotonic() + 120
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
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.1)
        yield served
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
