"""Shared fixtures: a tiny model, a started core service, and a real server on free ports."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from prismgate.thread_server import RunningGateway, serve_in_thread
from tests.tiny_model import build_eos_free_llama, build_random_pack, build_tiny_llama

TINY_MODEL_ID = "tiny-llama"
LONG_CONTEXT = 4096


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / TINY_MODEL_ID)


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 4k context that never stops at EOS: generations that last seconds."""
    return build_eos_free_llama(tmp_path_factory.mktemp("long-model") / TINY_MODEL_ID, max_len=LONG_CONTEXT)


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
    from prismgate.compose import build_service

    service = build_service(tiny_settings(tiny_model_dir, tiny_pack))
    await service.pool.start()
    try:
        yield service
    finally:
        await service.pool.close()


LiveServer = RunningGateway  # a real gateway on its own thread: .http_url, .ws_url, .grpc_target, .call()


def run_server(settings: Any, engine: Any = None) -> contextlib.AbstractContextManager[LiveServer]:
    """A real gateway (uvicorn + grpc.aio, one loop) in a background thread."""
    return serve_in_thread(settings, engine=engine, ready_timeout=120)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that drives the real browser is in the browser tier, whatever its file."""
    for item in items:
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
