"""Fixtures for the reliability tests: servers around chosen engines, and health checks.

The whole folder runs in CI in a bounded time (about three minutes on 2 cores): every
fuzzer has a fixed seed and case count, the load test a fixed duration, every wait a limit.
"""

from __future__ import annotations

import contextlib
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
