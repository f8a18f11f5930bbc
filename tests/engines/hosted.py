"""The transformers engine in an engine host process, reached over its Unix socket as a RemoteEngine.

What a ``--workers`` front-end sees of the engine (``prismgate.workers``), packaged as one
Engine so that the conformance suite runs against it unchanged
(``tests/engines/test_remote_conformance.py``): every event, error and cancellation crosses
the real IPC.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from prismgate.core.engine import EngineInfo, EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Event
from prismgate.core.health import LOADING, Health
from prismgate.settings import Settings
from prismgate.workers.host import host_main
from prismgate.workers.remote import HostLink, RemoteEngine


def _engines(model_dir: Path, pack: Path | None, model_id: str, _settings: Settings) -> list[Any]:
    from tests.engines.conftest import make_engine

    return [make_engine("transformers", model_dir, pack, model_id=model_id)]


class HostedEngine:
    def __init__(self, model_dir: Path, pack: Path | None, model_id: str = "tiny-llama") -> None:
        self.model_id = model_id
        self._factory = functools.partial(_engines, model_dir, pack, model_id)
        self._folder = tempfile.mkdtemp(prefix="prismgate-host-")
        self._path = os.path.join(self._folder, "engine.sock")
        self._process: Any = None
        self._link: HostLink | None = None
        self._remote: RemoteEngine | None = None

    @property
    def info(self) -> EngineInfo:
        if self._remote is None:
            raise GatewayError(Code.UNAVAILABLE, "not started")
        return self._remote.info

    async def start(self) -> None:
        self._process = multiprocessing.get_context("spawn").Process(
            target=host_main, args=(Settings(), self._path, self._factory)
        )
        self._process.start()
        while not Path(self._path).exists():  # noqa: ASYNC240 (a stat, while waiting for a child)
            assert self._process.is_alive(), "the engine host died"
            await asyncio.sleep(0.02)
        self._link = HostLink(self._path, workers=1)
        await self._link.connect()
        self._remote = RemoteEngine(self._link, self.model_id)
        await self._remote.start()

    def health(self) -> Health:
        return LOADING if self._remote is None else self._remote.health()

    async def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        if self._remote is None:
            raise GatewayError(Code.UNAVAILABLE, f"model {self.model_id!r} is still loading")
        stream = self._remote.generate(request)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    def image_tokens(self, data: bytes, mime: str) -> int:
        assert self._remote is not None
        return self._remote.image_tokens(data, mime)

    def release(self, session_key: str) -> None:
        if self._remote is not None:
            self._remote.release(session_key)

    def in_flight(self) -> int:
        return 0 if self._remote is None else self._remote.in_flight()

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
        if self._process is not None and self._process.is_alive():
            os.kill(self._process.pid, signal.SIGTERM)
            await asyncio.to_thread(self._process.join, 30)
        shutil.rmtree(self._folder, ignore_errors=True)
