"""Fixtures for the reliability tests: servers around chosen engines, and health checks.

The whole folder runs in CI in a bounded time (about three minutes on 2 cores): every
fuzzer has a fixed seed and case count, the load test a fixed duration, every wait a limit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer, run_server, tiny_settings
from tests.tiny_model import build_random_pack

BIG_PACK_CONCEPTS = 256  # readouts of 2 x 256 float32 per token: kilobytes per event on the wire


@pytest.fixture(scope="session")
def big_pack(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_pack(tmp_path_factory.mktemp("reliability-pack"), long_model_dir, n_concepts=BIG_PACK_CONCEPTS)


def run_gateway(settings: Any, engine: Any = None) -> contextlib.AbstractContextManager[LiveServer]:
    """``tests.conftest.run_server``, around a prebuilt engine when one is given."""
    return run_server(settings, engine=engine)


@pytest.fixture(scope="module")
def long_server(long_model_dir: Path, big_pack: Path) -> Iterator[LiveServer]:
    """A gateway on the EOS-free 4k-context tiny model with a 256-concept pack."""
    with run_gateway(tiny_settings(long_model_dir, big_pack)) as server:
        yield server


# -- checks ---------------------------------------------------------------------------------


def engine_of(server: LiveServer) -> Any:
    return server.service.pool.engine()


def decoded(server: LiveServer) -> int:
    return int(engine_of(server).stats["decoded_tokens"])


def wait_until(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def wait_engine_idle(server: LiveServer, timeout: float = 10.0) -> bool:
    """No request left in the engine and no admission slot held."""
    pool = server.service.pool
    return wait_until(lambda: engine_of(server).in_flight() == 0 and pool.admission.active == 0, timeout)


def busy_sessions(server: LiveServer) -> list[str]:
    return [s.id for s in list(server.service.store._sessions.values()) if s.busy]


def assert_healthy(server: LiveServer) -> None:
    """The server answers on every transport and can still generate; nothing is left running."""
    assert wait_engine_idle(server), f"engine still has {engine_of(server).in_flight()} requests in flight"
    assert not busy_sessions(server), "sessions left busy"
    with httpx.Client(timeout=10) as http:
        assert http.get(server.http_url + "/healthz").text == "ok"
        assert http.get(server.http_url + "/readyz").status_code == 200
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sid = stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID), timeout=10).session_id
        events = list(
            stub.Generate(
                spb.GenerateRequest(session_id=sid, offset=0, append_tokens=[72, 105], max_tokens=3, top_k=1),
                timeout=30,
            )
        )
        assert events[-1].WhichOneof("event") == "done"
        stub.CloseSession(spb.CloseSessionRequest(session_id=sid), timeout=10)


# -- under attack: a health probe, a victim and the server's memory ---------------------------

PROBE_SOURCE = "127.0.0.2"  # its own address: per-address caps aimed at the attacker must not hit it
PROBE_LIMIT_S = 1.0  # generous: two shared cores; a frozen event loop shows up as seconds
VICTIM_PROMPT = [72, 105]


def rss_mb(pid: int | None = None) -> float:
    """Resident memory of ``pid`` (default: this process, which runs the in-thread servers)."""
    with open(f"/proc/{pid or 'self'}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/<pid>/status")


class UnderAttack:
    """While an attack runs: ``/healthz`` probed in a loop, a normal client served in a loop, RSS sampled.

    On exit it asserts that every probe answered within ``probe_limit_s``, that the victim
    (a two-token OpenAI completion) completed at least once and never took longer than
    ``victim_limit_s``, and that RSS grew by less than ``rss_limit_mb``. ``report()`` gives
    the numbers (bench/hostile.py prints them).
    """

    def __init__(
        self,
        http_url: str,
        *,
        pid: int | None = None,
        probe_limit_s: float = PROBE_LIMIT_S,
        victim_limit_s: float = 10.0,
        rss_limit_mb: float = 300.0,
        model: str = TINY_MODEL_ID,
    ) -> None:
        self.http_url = http_url
        self.pid = pid
        self.probe_limit_s = probe_limit_s
        self.victim_limit_s = victim_limit_s
        self.rss_limit_mb = rss_limit_mb
        self.model = model
        self.probe_worst = 0.0
        self.victim_worst = 0.0
        self.victims = 0
        self.failures: list[str] = []
        self.rss_before = self.rss_peak = 0.0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=t, daemon=True) for t in (self._probe, self._victim, self._rss)]

    def _probe(self) -> None:
        transport = httpx.HTTPTransport(local_address=PROBE_SOURCE)
        with httpx.Client(transport=transport, timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    if client.get(self.http_url + "/healthz").status_code != 200:
                        self.failures.append("a /healthz probe failed")
                except httpx.HTTPError as exc:
                    self.failures.append(f"/healthz: {exc!r}")
                self.probe_worst = max(self.probe_worst, time.perf_counter() - started)
                time.sleep(0.02)

    def _victim(self) -> None:
        body = {"model": self.model, "prompt": VICTIM_PROMPT, "max_tokens": 2, "temperature": 0}
        transport = httpx.HTTPTransport(local_address=PROBE_SOURCE)
        with httpx.Client(transport=transport, timeout=120) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    reply = client.post(self.http_url + "/v1/completions", json=body)
                    if reply.status_code != 200:
                        self.failures.append(f"the victim got {reply.status_code}: {reply.text[:200]}")
                    else:
                        self.victims += 1
                except httpx.HTTPError as exc:
                    self.failures.append(f"the victim: {exc!r}")
                self.victim_worst = max(self.victim_worst, time.perf_counter() - started)
                time.sleep(0.05)

    def _rss(self) -> None:
        while not self._stop.is_set():
            self.rss_peak = max(self.rss_peak, rss_mb(self.pid))
            time.sleep(0.05)

    def wait_for_victims(self, count: int = 1, timeout: float = 60.0) -> None:
        """Until the victim has been served ``count`` more times (during the attack, not after it)."""
        target = self.victims + count
        assert wait_until(lambda: self.victims >= target, timeout), f"the victim was not served within {timeout}s"

    def start(self) -> UnderAttack:
        self.rss_before = self.rss_peak = rss_mb(self.pid)
        for thread in self._threads:
            thread.start()
        return self

    def __enter__(self) -> UnderAttack:
        return self.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(130)

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:  # an attack shorter than one request: the victim's request overlaps its end
            wait_until(lambda: self.victims >= 1 or bool(self.failures), self.victim_limit_s)
        self.stop()
        if kind is not None:
            return
        assert not self.failures, self.failures[:5]
        assert self.victims >= 1, "the victim was never served during the attack"
        assert self.probe_worst < self.probe_limit_s, f"a /healthz probe took {self.probe_worst:.3f}s"
        assert self.victim_worst < self.victim_limit_s, f"the victim took {self.victim_worst:.2f}s"
        assert self.rss_growth < self.rss_limit_mb, f"RSS grew by {self.rss_growth:.0f} MB"

    @property
    def rss_growth(self) -> float:
        return self.rss_peak - self.rss_before

    def report(self) -> dict[str, float]:
        return {
            "probe_worst_s": self.probe_worst,
            "victim_worst_s": self.victim_worst,
            "victims": self.victims,
            "rss_growth_mb": self.rss_growth,
        }
