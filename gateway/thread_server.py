"""A whole gateway on a background thread: for tests, benchmarks and notebooks.

The gateway runs exactly as ``prismgate serve`` runs it (uvicorn and grpc.aio on one
event loop, one engine pool), on a thread of its own, so the caller's thread is free to
act as a client over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from prismgate.compose import build_service
from prismgate.core.engine import Engine
from prismgate.core.service import SessionService
from prismgate.server import Gateway
from prismgate.settings import Settings

T = TypeVar("T")


@dataclass
class RunningGateway:
    gateway: Gateway
    loop: asyncio.AbstractEventLoop

    @property
    def host(self) -> str:
        host = self.gateway.settings.server.host
        return "127.0.0.1" if host in {"0.0.0.0", ""} else host

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.gateway.http_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.gateway.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.host}:{self.gateway.grpc_port}"

    @property
    def service(self) -> SessionService:
        return self.gateway.service

    @property
    def engine(self) -> Engine:
        return self.gateway.service.pool.engine()

    def call(self, coro: Awaitable[T], timeout: float = 60.0) -> T:
        """Run a coroutine on the gateway's own event loop (to drive or inspect it in-process)."""
        return asyncio.run_coroutine_threadsafe(_as_coroutine(coro), self.loop).result(timeout)


async def _cancel_leftovers() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


@contextlib.contextmanager
def serve_in_thread(
    settings: Settings, *, engine: Engine | None = None, ready_timeout: float = 300.0
) -> Iterator[RunningGateway]:
    """Start a gateway (around ``engine``, or the one ``settings`` name), wait until ready, stop it after."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="prismgate-gateway", daemon=True)
    thread.start()

    async def start() -> Gateway:
        gateway = Gateway(settings, service=build_service(settings, engine=engine))
        await gateway.start()
        await gateway.wait_ready(ready_timeout)
        return gateway

    def on_loop(coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    try:
        gateway = on_loop(start(), ready_timeout + 60)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        raise
    try:
        yield RunningGateway(gateway, loop)
    finally:
        on_loop(gateway.stop(), settings.server.shutdown_grace_s + 60)
        on_loop(_cancel_leftovers(), 10)  # as asyncio.run does: no task outlives its loop
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
