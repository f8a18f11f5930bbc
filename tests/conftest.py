"""Shared fixtures: a tiny model, a started core service, and a real server on free ports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.tiny_model import build_random_pack, build_tiny_llama

TINY_MODEL_ID = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / TINY_MODEL_ID)


@pytest.fixture(scope="session")
def tiny_pack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_pack(tmp_path_factory.mktemp("packs"), tiny_model_dir)


def tiny_settings(model_dir: Path, pack: Path, **overrides: Any) -> Any:
    from prismgate.settings import Settings

    values: dict[str, Any] = {
        "model": str(model_dir),
        "model_name": TINY_MODEL_ID,
        "concept_pack": str(pack),
        "threads": 1,
        "host": "127.0.0.1",
        "http_port": 0,
        "grpc_port": 0,
        "shutdown_grace_s": 2.0,
    }
    values.update(overrides)
    return Settings.load(values, env={})


@pytest.fixture
async def tiny_service(tiny_model_dir: Path, tiny_pack: Path) -> AsyncIterator[Any]:
    """A started SessionService on the tiny model (one per test: engines hold threads)."""
    from prismgate.runtime import build_service

    service = build_service(tiny_settings(tiny_model_dir, tiny_pack))
    await service.pool.start()
    try:
        yield service
    finally:
        await service.pool.close()


@dataclass
class LiveServer:
    gateway: Any
    loop: asyncio.AbstractEventLoop

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.gateway.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    @property
    def service(self) -> Any:
        return self.gateway.service

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's own event loop (to inspect or change its state)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def run_server(settings: Any) -> Iterator[LiveServer]:
    """A real gateway (uvicorn + grpc.aio, one loop) in a background thread."""
    from prismgate.server import Gateway

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()

    async def start() -> Any:
        gateway = Gateway(settings)
        await gateway.start()
        await gateway.wait_ready()
        return gateway

    gateway = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    try:
        yield LiveServer(gateway, loop)
    finally:
        asyncio.run_coroutine_threadsafe(gateway.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path, tiny_pack: Path) -> Iterator[LiveServer]:
    """One server for the whole session, default settings (no auth)."""
    with run_server(tiny_settings(tiny_model_dir, tiny_pack)) as server:
        yield server


@pytest.fixture(scope="session")
def server_factory(
    tiny_model_dir: Path, tiny_pack: Path
) -> Callable[..., contextlib.AbstractContextManager[LiveServer]]:
    """Start a server with settings overrides: ``with server_factory(auth_token="s3cret") as srv: ...``."""

    def factory(**overrides: Any) -> contextlib.AbstractContextManager[LiveServer]:
        return run_server(tiny_settings(tiny_model_dir, tiny_pack, **overrides))

    return factory
