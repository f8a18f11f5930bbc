"""One process, one event loop: uvicorn for HTTP and grpc.aio for gRPC, one engine pool.

The model loads in the background so that ``/healthz`` answers at once and ``/readyz`` turns
ready when the engine is. Shutdown (SIGTERM or SIGINT; a second signal skips the wait): stop
accepting (``/readyz`` and gRPC health NOT_SERVING, listeners closed, new generations
UNAVAILABLE), let in-flight generations finish until ``shutdown_grace_s``, then close
connections (WebSockets with 1012) and cancel what still runs, release every session, close
the engine and exit 0 (docs/operations.md, "Shutdown").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prismgate import reflection
from prismgate.app import create_app
from prismgate.arenas import limit_malloc_arenas
from prismgate.compose import build_service
from prismgate.core.errors import GatewayError
from prismgate.core.service import SessionService
from prismgate.drain import Drain
from prismgate.edge import accept_errors, log_scrub
from prismgate.edge.connections import guarded_http
from prismgate.keys import reload_all, ring_for
from prismgate.metrics import GatewayMetrics
from prismgate.observer import GenerationObserver
from prismgate.settings import Settings

log = logging.getLogger(__name__)

EVICTION_PERIOD_S = 30.0
CUT_OFF_S = 2.0  # after the grace period: time for cut-off generations to send their errors and unwind


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
    def __init__(
        self,
        settings: Settings,
        service: SessionService | None = None,
        *,
        http_socket: socket.socket | None = None,
        shared_ports: bool = False,
    ) -> None:
        """``http_socket``: a listening socket bound by the supervisor (``--workers``); ``shared_ports``:
        this is one of several front-end processes, so the gRPC port is bound with SO_REUSEPORT
        (the supervisor has checked that no other program holds it)."""
        self.settings = settings
        self._http_socket = http_socket
        self._shared_ports = shared_ports
        self.keys = ring_for(settings.security)  # a keys file that does not parse stops the start here
        self.service = service or build_service(settings)
        self.metrics = GatewayMetrics()
        self.metrics.bind(self.service)
        self.drain = Drain(settings.server.shutdown_grace_s)
        self.observer = GenerationObserver(self.metrics, settings, self.service, self.drain, self.keys)
        self.service.monitor = self.observer
        self.app = create_app(self.service, settings, metrics=self.metrics, drain=self.drain)
        self.http_port = settings.server.http_port
        self.grpc_port = settings.server.grpc_port
        self._uvicorn: _Uvicorn | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._stopping = False
        self._skip_grace = asyncio.Event()
        self.failed = False

    async def start(self) -> None:
        """Bind both ports and start serving; the model keeps loading in the background."""
        s = self.settings
        limit_malloc_arenas()
        log_scrub.install()
        accept_errors.install(asyncio.get_running_loop())
        http_socket = self._http_socket or _listen_http(s.server.host, s.server.http_port)
        self.http_port = http_socket.getsockname()[1]
        options = [
            ("grpc.max_receive_message_length", s.grpc.max_message_bytes),
            ("grpc.max_send_message_length", s.grpc.max_message_bytes),
            # a second server on this port must fail, not share it silently; the front-ends of one
            # server share it (prismgate.workers.supervisor holds the port against other programs)
            ("grpc.so_reuseport", 1 if self._shared_ports else 0),
        ]
        self._grpc = grpc.aio.server(options=options)
        names = grpc_services(self._grpc, self.service, s)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        for name in ["", *names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable(self._grpc, [*names, health.SERVICE_NAME])
        try:
            self.grpc_port = self._grpc.add_insecure_port(f"{_grpc_host(s.server.host)}:{s.server.grpc_port}")
        except RuntimeError as exc:  # grpc reports a failed bind this way
            self.grpc_port = 0
            reason = str(exc)
        else:
            reason = "the address is in use or not available"
        if self.grpc_port == 0:
            http_socket.close()
            raise CannotListen(s.server.host, s.server.grpc_port, "--grpc-port", reason)
        await self._grpc.start()

        config = uvicorn.Config(
            self.app,
            http=guarded_http(s.http, self.app.state.clients, self.observer.refused),
            log_config=None,
            lifespan="off",
            timeout_graceful_shutdown=math.ceil(s.server.shutdown_grace_s),
            ws_max_size=s.grpc.max_message_bytes,
            timeout_keep_alive=max(1, math.ceil(s.http.keep_alive_s)),
            access_log=False,
        )
        self._uvicorn = _Uvicorn(config)
        self._uvicorn_task = asyncio.create_task(self._uvicorn.serve(sockets=[http_socket]), name="uvicorn")
        self._tasks.append(asyncio.create_task(self._load(names), name="model-load"))
        self._tasks.append(asyncio.create_task(self._evict(), name="session-eviction"))
        log.info(
            "HTTP on %s:%d, gRPC on %s:%d",
            s.server.host,
            self.http_port,
            s.server.host,
            self.grpc_port,
            extra={"http_port": self.http_port, "grpc_port": self.grpc_port},
        )
        if s.server.port_file:
            _write_port_file(Path(s.server.port_file), self.http_port, self.grpc_port)

    async def _load(self, names: list[str]) -> None:
        started = time.perf_counter()
        try:
            await self.service.pool.start()
        except Exception:
            log.exception("the engine failed to start")
            self.failed = True
            self._stopped.set()
            raise
        seconds = time.perf_counter() - started
        info = self.service.info()
        self.metrics.model_loaded(info, seconds)
        assert self._health is not None
        for name in ["", *names]:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "ready: %s",
            info.model_id,
            extra={"model": info.model_id, "engine": info.engine_name, "load_s": round(seconds, 3)},
        )

    async def _evict(self) -> None:
        while True:
            await asyncio.sleep(EVICTION_PERIOD_S)
            evicted = await self.service.store.evict_expired()
            if evicted:
                log.info("evicted %d idle sessions", len(evicted))

    async def wait_ready(self, timeout: float = 300.0) -> None:  # noqa: ASYNC109 (public API)
        async with asyncio.timeout(timeout):
            while not self.service.pool.ready:
                if self._stopped.is_set():
                    raise RuntimeError("the gateway stopped before it was ready")
                await asyncio.sleep(0.05)

    def skip_grace(self) -> None:
        """End the grace period now: what is still running gets cancelled (a second SIGTERM)."""
        self._skip_grace.set()

    async def stop(self) -> None:
        """Stop accepting, give in-flight generations the grace period, cancel the rest, close everything."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        loop = asyncio.get_running_loop()
        grace = max(0.0, self.settings.server.shutdown_grace_s)
        deadline = loop.time() + grace
        t0 = loop.time()

        # 1. stop accepting
        self.service.pool.begin_stopping()  # /readyz answers 503: load balancers take this replica out
        self.metrics.ready.set(0)
        self.drain.start_draining()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._uvicorn is not None:
            for listener in self._uvicorn.servers:
                listener.close()
        # gRPC refuses new calls from now on; its own cut-off comes after ours (step 3), so that
        # generations end with a status rather than a dropped call
        grpc_stop = asyncio.ensure_future(self._grpc.stop(grace + CUT_OFF_S)) if self._grpc is not None else None

        # 2. let in-flight generations finish
        in_flight = self.drain.in_flight
        drained = await self.drain.wait_idle(deadline - loop.time(), abort=self._skip_grace)
        log.info(
            "drained" if drained else "grace period over",
            extra={
                "in_flight_at_stop": in_flight,
                "still_running": self.drain.in_flight,
                "waited_s": round(loop.time() - t0, 3),
            },
        )

        # 3. end what outlived the grace period (each codec reports UNAVAILABLE on its wire),
        #    then close connections: idle keep-alives and WebSockets (1012) go at once
        cut = self.drain.cut_off() if not drained else 0
        if cut:
            await self.drain.wait_idle(CUT_OFF_S)
        if self._uvicorn is not None and self._uvicorn_task is not None:
            # responses still being written get a moment; uvicorn cancels what remains after it
            self._uvicorn.config.timeout_graceful_shutdown = math.ceil(CUT_OFF_S) if cut else 1
            self._uvicorn.should_exit = True
            await asyncio.gather(self._uvicorn_task, return_exceptions=True)
        if grpc_stop is not None and self._grpc is not None:
            # calls still open (idle bidi streams, health watches) get one more second, then CANCELLED
            await self._grpc.stop(0 if self._skip_grace.is_set() else 1.0)
            await asyncio.gather(grpc_stop, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

        # 4. release sessions and the engine
        sessions = await self.service.store.close_all()
        await self.service.quota.close()
        await self.service.pool.close()
        if self.settings.server.port_file:
            with contextlib.suppress(OSError):
                os.remove(self.settings.server.port_file)
        log.info(
            "stopped",
            extra={"sessions_closed": sessions, "cut_off": cut, "shutdown_s": round(loop.time() - t0, 3)},
        )
        self._stopped.set()

    async def run_until_signal(
        self,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
        started: Callable[[], None] | None = None,
    ) -> None:
        """Serve until one of ``signals``; ``started`` is called once both ports serve (a front-end
        process tells its supervisor)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                log.warning("second %s: cancelling what is still running", signal.Signals(signum).name)
                self.skip_grace()
            stop.set()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, reload_all)  # the keys file, read again (docs/keys.md)
        await self.start()
        if started is not None:
            started()
        waiter = asyncio.create_task(stop.wait())
        stopped = asyncio.create_task(self._stopped.wait())
        await asyncio.wait({waiter, stopped}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        stopped.cancel()
        log.info(
            "shutting down (grace %.1fs)",
            self.settings.server.shutdown_grace_s,
            extra={"in_flight": self.drain.in_flight},
        )
        await self.stop()


class CannotListen(OSError):
    """A port could not be bound: one line that names the address and the flag that sets it."""

    def __init__(self, host: str, port: int, flag: str, reason: str) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({reason}); choose another port with {flag}")


def _listen_http(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio turns on TCP_NODELAY only for sockets whose proto says TCP,
    # and without it a keep-alive response (headers, then body) waits ~40 ms for a delayed ACK.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # SO_REUSEADDR lets a restart bind while old connections sit in TIME_WAIT; on Linux
        # it does not let two servers listen on one port (SO_REUSEPORT would)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise CannotListen(host, port, "--http-port", exc.strerror or str(exc)) from None
    sock.setblocking(False)
    return sock


def _write_port_file(path: Path, http_port: int, grpc_port: int) -> None:
    """Write atomically, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(json.dumps({"http_port": http_port, "grpc_port": grpc_port, "pid": os.getpid()}))
    staging.replace(path)


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT; the exit status is 0 after a clean stop, 1 if a port, the keys file or the
    model failed. With ``workers`` > 1, the supervisor of several front-ends (:mod:`prismgate.workers`)."""
    if settings.server.workers > 1:
        from prismgate.workers.supervisor import serve_workers

        return serve_workers(settings)
    try:
        gateway = Gateway(settings)
    except (GatewayError, OSError) as exc:
        log.error("cannot start: %s", exc)
        return 1
    try:
        asyncio.run(gateway.run_until_signal())
    except CannotListen as exc:
        log.error("%s", exc)
        return 1
    finally:
        # The interpreter's exit ends with a full garbage collection over every object torch and
        # transformers made: with the default model, 3 s between "stopped" and the process's end
        # on an idle server. Frozen objects are not walked; nothing but the exit runs after this.
        gc.freeze()
    return 1 if gateway.failed else 0
