"""One process, one event loop: uvicorn for HTTP and grpc.aio for gRPC, one engine pool.

The model loads in the background so that ``/healthz`` answers at once and
``/readyz`` turns ready when the engine is. On SIGTERM or SIGINT the gateway stops
accepting, lets in-flight streams finish within ``shutdown_grace_s``, cancels the
rest, closes the engine and returns (exit status 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prismgate.app import create_app
from prismgate.core.service import SessionService
from prismgate.runtime import build_service
from prismgate.settings import Settings

log = logging.getLogger(__name__)

EVICTION_PERIOD_S = 30.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the Gateway owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def grpc_services(server: grpc.aio.Server, service: SessionService, settings: Settings) -> list[str]:
    from prismgate.codecs import evergreen, salience

    names: list[str] = []
    for codec in (salience, evergreen):
        names += codec.add_to_server(server, service, settings)
    return names


class Gateway:
    def __init__(self, settings: Settings, service: SessionService | None = None) -> None:
        self.settings = settings
        self.service = service or build_service(settings)
        self.app = create_app(self.service, settings)
        self.http_port = settings.http_port
        self.grpc_port = settings.grpc_port
        self._uvicorn: _Uvicorn | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self.failed = False

    async def start(self) -> None:
        """Bind both ports and start serving; the model keeps loading in the background."""
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.grpc_max_message_bytes),
            ("grpc.max_send_message_length", s.grpc_max_message_bytes),
        ]
        self._grpc = grpc.aio.server(options=options)
        names = grpc_services(self._grpc, self.service, s)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        for name in ["", *names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"{_grpc_host(s.host)}:{s.grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC port {s.host}:{s.grpc_port}")
        await self._grpc.start()

        sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((s.host, s.http_port))
        sock.listen(2048)
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, lifespan="off", timeout_graceful_shutdown=int(s.shutdown_grace_s) or 1,
            ws_max_size=s.grpc_max_message_bytes, access_log=False,
        )
        self._uvicorn = _Uvicorn(config)
        self._tasks.append(asyncio.create_task(self._uvicorn.serve(sockets=[sock]), name="uvicorn"))
        self._tasks.append(asyncio.create_task(self._load(names), name="model-load"))
        self._tasks.append(asyncio.create_task(self._evict(), name="session-eviction"))
        log.info("HTTP on %s:%d, gRPC on %s:%d", s.host, self.http_port, s.host, self.grpc_port)

    async def _load(self, names: list[str]) -> None:
        try:
            await self.service.pool.start()
        except Exception:
            log.exception("the engine failed to start")
            self.failed = True
            self._stopped.set()
            raise
        assert self._health is not None
        for name in ["", *names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("ready: %s", self.service.pool.default_model)

    async def _evict(self) -> None:
        while True:
            await asyncio.sleep(EVICTION_PERIOD_S)
            evicted = self.service.store.evict_expired()
            if evicted:
                log.info("evicted %d idle sessions", len(evicted))

    async def wait_ready(self, timeout: float = 300.0) -> None:
        async with asyncio.timeout(timeout):
            while not self.service.pool.ready:
                if self._stopped.is_set():
                    raise RuntimeError("the gateway stopped before it was ready")
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Stop accepting, give in-flight streams the grace period, then close everything."""
        grace = self.settings.shutdown_grace_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        waits = []
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            waits.append(self._tasks[0])
        if self._grpc is not None:
            waits.append(asyncio.ensure_future(self._grpc.stop(grace)))
        await asyncio.gather(*waits, return_exceptions=True)
        for task in self._tasks[1:]:
            task.cancel()
        await asyncio.gather(*self._tasks[1:], return_exceptions=True)
        await self.service.pool.close()
        self._stopped.set()

    async def run_until_signal(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        waiter = asyncio.create_task(stop.wait())
        stopped = asyncio.create_task(self._stopped.wait())
        await asyncio.wait({waiter, stopped}, return_when=asyncio.FIRST_COMPLETED)
        log.info("shutting down (grace %.0fs)", self.settings.shutdown_grace_s)
        await self.stop()


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; the exit status is 0 after a clean stop, 1 if the model failed to load."""
    gateway = Gateway(settings)
    asyncio.run(gateway.run_until_signal())
    return 1 if gateway.failed else 0
