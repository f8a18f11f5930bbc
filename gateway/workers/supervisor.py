"""``prismgate serve --workers N``: one engine host and N front-end processes, started and stopped in order.

The supervisor (the process the user started) serves nothing itself: it binds the ports once,
starts the engine host and the front-ends (which inherit the HTTP listener and join the gRPC
port), writes the port file once all serve, passes signals on, and stops everything (exit 1)
when a process dies on its own rather than restarting it. The whole design, port binding,
readiness, shutdown and metrics: docs/architecture.md, "Several front-end processes".
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from prismgate.settings import Settings

if TYPE_CHECKING:
    from prismgate.workers.host import EngineFactory

log = logging.getLogger("prismgate.workers")

HOST_SOCKET_WAIT_S = 120.0
PR_SET_PDEATHSIG = 1
WORKER_HEADER = b"prismgate-worker"


def serve_workers(settings: Settings, engines: EngineFactory | None = None) -> int:
    """Run until SIGTERM/SIGINT; 0 after a clean stop, 1 when a port could not be bound or a process failed.

    ``engines``: a picklable function that builds the engines in the host (a benchmark's null
    engine); None: the settings' models."""
    from prismgate.server import CannotListen, _listen_http, _write_port_file

    n = settings.server.workers
    try:
        http_socket = _listen_http(settings.server.host, settings.server.http_port)
        grpc_guard = _hold_grpc_port(settings.server.host, settings.server.grpc_port)
    except CannotListen as exc:
        log.error("%s", exc)
        return 1
    http_port, grpc_port = http_socket.getsockname()[1], grpc_guard.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="prismgate-")  # 0700: only this user reaches the engine socket
    path = os.path.join(folder, "engine.sock")
    metrics_dir = os.path.join(folder, "metrics")
    os.mkdir(metrics_dir)
    spawn = multiprocessing.get_context("spawn")
    stopping = {"signals": 0}

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping["signals"] += 1

    frontends: list[Any] = []

    def reload_keys(_signum: int, _frame: FrameType | None) -> None:
        for process in frontends:  # each front-end reads the keys file again (docs/keys.md)
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGHUP)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, reload_keys)
    host = spawn.Process(
        target=_host_entry, args=(settings, path, engines, os.getpid()), name="prismgate-engine-host", daemon=False
    )
    host.start()
    status = 0
    try:
        deadline = time.monotonic() + HOST_SOCKET_WAIT_S
        while not os.path.exists(path):
            if not host.is_alive() or time.monotonic() > deadline or stopping["signals"]:
                log.error("the engine host did not start (exit status %s)", host.exitcode)
                return 1
            time.sleep(0.02)
        front = settings.replace(http_port=http_port, grpc_port=grpc_port, port_file=None)
        previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the front-ends, not the host, count
        started = [spawn.Event() for _ in range(n)]
        try:
            for index in range(n):
                process = spawn.Process(
                    target=frontend_main,
                    args=(front, http_socket, path, index, started[index], os.getpid()),
                    name=f"prismgate-frontend-{index}",
                    daemon=False,
                )
                process.start()
                frontends.append(process)
        finally:
            if previous is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
        http_socket.close()  # the front-ends hold it now
        while not all(event.is_set() for event in started):  # the port file promises a server that answers
            if stopping["signals"] or not all(p.is_alive() for p in [host, *frontends]):
                break
            time.sleep(0.02)
        log.info(
            "HTTP on %s:%d, gRPC on %s:%d, %d front-end processes over one engine host",
            settings.server.host,
            http_port,
            settings.server.host,
            grpc_port,
            n,
            extra={"http_port": http_port, "grpc_port": grpc_port, "workers": n, "host_pid": host.pid},
        )
        if settings.server.port_file:
            _write_port_file(Path(settings.server.port_file), http_port, grpc_port)
        status = _watch(host, frontends, stopping)
    finally:
        _stop(host, frontends, stopping)
        grpc_guard.close()
        if settings.server.port_file:
            with contextlib.suppress(OSError):
                os.remove(settings.server.port_file)
        shutil.rmtree(folder, ignore_errors=True)
    if any(p.exitcode not in (0, None) for p in [*frontends, host]):
        status = 1
    log.info("stopped", extra={"exit_status": status})
    return status


def _watch(host: Any, frontends: list[Any], stopping: dict[str, int]) -> int:
    """Wait for a signal (0) or a process that dies on its own (1)."""
    from prometheus_client import multiprocess

    everyone = [host, *frontends]
    while not stopping["signals"]:
        multiprocessing.connection.wait([p.sentinel for p in everyone], timeout=0.2)
        dead = [p for p in everyone if not p.is_alive()]
        if dead:
            for process in dead:
                log.error("%s exited with status %s; stopping the server", process.name, process.exitcode)
                if process is not host:
                    multiprocess.mark_process_dead(process.pid)
            return 1
    return 0


def _stop(host: Any, frontends: list[Any], stopping: dict[str, int]) -> None:
    """SIGTERM to every front-end (each drains), a second one when a second signal comes, then the host."""
    passed = 0
    while any(p.is_alive() for p in frontends):
        wanted = max(1, stopping["signals"])
        while passed < min(wanted, 2):
            passed += 1
            for process in frontends:
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signal.SIGTERM)
        multiprocessing.connection.wait([p.sentinel for p in frontends if p.is_alive()], timeout=0.2)
    if host.is_alive() and host.pid is not None:
        os.kill(host.pid, signal.SIGTERM)
        host.join(60)
        if host.is_alive():
            host.kill()
            host.join()


def _hold_grpc_port(host: str, port: int) -> socket.socket:
    """Bind the gRPC port with SO_REUSEPORT (not listening): the front-ends' gRPC servers join it,
    a program that holds it already makes this fail, and one that comes later cannot take it."""
    from prismgate.server import CannotListen

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CannotListen(host, port, "--grpc-port", exc.strerror or str(exc)) from None
    return sock


def die_with_parent(parent: int) -> None:
    """SIGTERM this process when the supervisor ``parent`` dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``): no engine host or front-end outlives its server."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the call above
        os.kill(os.getpid(), signal.SIGTERM)


def _host_entry(settings: Settings, path: str, engines: EngineFactory | None, parent: int) -> None:
    die_with_parent(parent)
    from prismgate.workers.host import host_main

    host_main(settings, path, engines)


def frontend_main(
    settings: Settings, http_socket: socket.socket, path: str, index: int, started: Any, parent: int
) -> None:
    """One front-end process: a whole gateway over the engine host, on the shared listener."""
    import asyncio
    import gc

    die_with_parent(parent)
    from prismgate import logs

    logs.configure(settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor passes every stop on as SIGTERM
    try:
        code = asyncio.run(_frontend(settings, http_socket, path, index, started.set))
    finally:
        gc.freeze()
    sys.exit(code)


async def _frontend(
    settings: Settings, http_socket: socket.socket, path: str, index: int, started: Callable[[], None]
) -> int:
    from prismgate.compose import build_budget, build_quota, build_store
    from prismgate.core.service import SessionService
    from prismgate.server import Gateway
    from prismgate.workers.remote import HostLink, RemotePool, RemoteQuota, RemoteStore

    link = HostLink(path, settings.server.workers)
    await link.connect()
    shared = link.holds_sessions
    service = SessionService(
        RemotePool(link),
        RemoteStore(link) if shared else build_store(settings),
        build_budget(settings),
        RemoteQuota(link) if shared else build_quota(settings),
        deterministic=settings.engine.deterministic,
        specials_in_text=settings.security.allow_special_tokens_in_text,
    )
    gateway = Gateway(settings, service, http_socket=http_socket, shared_ports=True)
    gateway.app.add_middleware(WorkerHeader, value=str(index).encode())
    try:
        await gateway.run_until_signal((signal.SIGTERM,), started)
    finally:
        await link.close()
    return 1 if gateway.failed else 0


class WorkerHeader:
    """``prismgate-worker: <index>`` on every HTTP response: which front-end answered (debugging, tests)."""

    def __init__(self, app: Any, value: bytes) -> None:
        self.app = app
        self.value = value

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (WORKER_HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, send=tagged)
