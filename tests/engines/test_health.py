"""Health through an engine's life, and the pool's health from its engines'.

Real engines on the tiny model; the broken one is a real model folder whose weights were
overwritten, so its load fails the way a corrupt download would.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from prismgate.core import health
from prismgate.core.actions import GenerateSpec
from prismgate.core.engine import EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.health import Health, HealthState
from prismgate.core.pool import EnginePool
from prismgate.engines.hf import TransformersEngine, scheduler
from tests.engines.requests import run


def engine(model_dir: Path, model_id: str = "tiny") -> TransformersEngine:
    return TransformersEngine(model_dir, model_id=model_id, threads=1, prefill_chunk=16)


@pytest.fixture
def broken_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    target = shutil.copytree(tiny_model_dir, tmp_path / "broken")
    (target / "model.safetensors").write_bytes(b"not a safetensors file")
    return target


async def test_the_pool_is_loading_then_ready_then_stopping_while_work_finishes(tiny_model_dir: Path) -> None:
    pool = EnginePool([engine(tiny_model_dir)])
    assert pool.health() == health.LOADING and not pool.ready
    await pool.start()
    try:
        assert pool.health() == health.READY and pool.ready
        request = EngineRequest(request_id="r", tokens=(5, 6, 7), spec=GenerateSpec(max_tokens=4, ignore_eos=True))
        stream = pool.generate(None, request)
        first = await anext(stream)
        pool.begin_stopping()  # draining: probes say STOPPING, the generation already running goes on
        assert pool.health() == health.STOPPING and pool.health().reason == "shutting down" and not pool.ready
        rest = [event async for event in stream]
        assert first.position == 3 and len(rest) == 4  # three more tokens, then Done
    finally:
        await pool.close()
    assert pool.health().state is HealthState.STOPPING
    assert pool.engine().health().state is HealthState.STOPPING


async def test_a_model_that_fails_to_load_reports_failed_with_the_reason(
    tiny_model_dir: Path, broken_model_dir: Path
) -> None:
    good, broken = engine(tiny_model_dir, "good"), engine(broken_model_dir, "broken")
    pool = EnginePool([good, broken])
    with pytest.raises(Exception):  # noqa: B017 (whatever safetensors raises for a corrupt file)
        await pool.start()
    try:
        state = broken.health()
        assert state.state is HealthState.FAILED and state.reason.startswith("broken failed to load: ")
        assert good.health().ready
        assert pool.health() == state and not pool.ready  # one failed engine keeps the pool out of service
    finally:
        await pool.close()


async def test_a_broken_worker_fails_its_requests_at_once_and_the_engine_reports_failed(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = engine(tiny_model_dir)
    await eng.start()
    try:

        def broken(*_args: object, **_kwargs: object) -> list[object]:
            raise RuntimeError("a scheduler bug")

        monkeypatch.setattr(scheduler, "batch_groups", broken)  # the loop itself breaks, outside model work
        with pytest.raises(GatewayError) as failed:
            await run(eng, (5, 6, 7), max_tokens=4)
        assert failed.value.code is Code.INTERNAL and "a scheduler bug" in failed.value.message
        state = eng.health()
        assert (
            state.state is HealthState.FAILED
            and state.reason == "tiny: the worker thread failed: RuntimeError: a scheduler bug"
        )
        with pytest.raises(GatewayError) as refused:
            await run(eng, (5, 6, 7), max_tokens=4)
        assert refused.value.code is Code.UNAVAILABLE and "the engine has failed" in refused.value.message
    finally:
        await eng.close()


def test_the_worst_state_wins() -> None:
    failed = health.failed("x")
    assert health.worst([]) == health.READY
    assert health.worst([health.READY, health.LOADING]) == health.LOADING
    assert health.worst([health.LOADING, failed, health.READY]) == failed
    assert health.worst([failed, health.STOPPING]) == health.STOPPING
    assert Health(HealthState.READY).ready and not failed.ready
