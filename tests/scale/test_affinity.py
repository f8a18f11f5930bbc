"""Two in-process replicas of one model: sessions spread out, and each stays where its cache is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from prismgate.core.actions import GenerateAction, GenerateSpec
from prismgate.core.events import Done, TokenEvent
from prismgate.core.service import SessionService
from tests.conftest import tiny_settings

PROMPT = list(range(10, 40))


@pytest.fixture
async def service(tiny_model_dir: Path, tiny_pack: Path) -> AsyncIterator[SessionService]:
    from prismgate.compose import build_service

    made = build_service(tiny_settings(tiny_model_dir, tiny_pack, replicas=2))
    await made.pool.start()
    try:
        yield made
    finally:
        await made.pool.close()


async def turn(service: SessionService, session_id: str, append: list[int], max_tokens: int = 4) -> Done:
    length = len(await service.dump(session_id))
    action = GenerateAction(
        append_tokens=append, offset=length, spec=GenerateSpec(max_tokens=max_tokens, top_k=1, ignore_eos=True)
    )
    done: Any = None
    async for event in service.generate(session_id, action):
        if not isinstance(event, TokenEvent):
            done = event
    assert isinstance(done, Done)
    return done


async def test_sessions_spread_over_replicas_and_stay_on_their_cache(service: SessionService) -> None:
    replicas = service.pool.replicas()
    assert len(replicas.engines) == 2
    a, b = (await service.open()).id, (await service.open()).id
    first = {sid: await turn(service, sid, PROMPT) for sid in (a, b)}
    assert {replicas.home(a), replicas.home(b)} == {0, 1}  # the second new session went to the emptier replica
    assert all(done.cached_tokens == 0 for done in first.values())
    for round_ in range(3):
        for sid in (a, b):
            length = len(await service.dump(sid))
            done = await turn(service, sid, [50 + round_])
            # the whole timeline but the last decoded token (not yet fed back) came from this replica's cache
            assert done.cached_tokens == length - 1, (sid, round_, done.cached_tokens, length)
    stats = [engine.stats for engine in replicas.engines]  # type: ignore[attr-defined]
    assert all(s["decoded_tokens"] == 4 * 4 for s in stats)  # each replica ran one session's four turns
    await service.close(a)
    assert replicas.home(a) is None and replicas.home(b) is not None


async def until(condition: Callable[[], bool], within: float = 30.0) -> None:
    async with asyncio.timeout(within):
        for _ in iter(condition, True):
            await asyncio.sleep(0.01)


@pytest.fixture
async def long_service(long_model_dir: Path, tiny_pack: Path) -> AsyncIterator[SessionService]:
    """Two replicas of the model that never stops at EOS: a generation keeps its replica busy."""
    from prismgate.compose import build_service

    made = build_service(tiny_settings(long_model_dir, tiny_pack, replicas=2, concept_pack="none"))
    await made.pool.start()
    try:
        yield made
    finally:
        await made.pool.close()


async def test_a_short_session_moves_off_a_busy_replica_and_a_long_one_waits_for_its_cache(
    long_service: SessionService,
) -> None:
    service = long_service
    replicas = service.pool.replicas()
    busy, other, short, long_ = [(await service.open()).id for _ in range(4)]
    await turn(service, busy, PROMPT, max_tokens=1)  # -> replica 0
    await turn(service, other, PROMPT, max_tokens=1)  # -> replica 1
    await turn(service, short, PROMPT, max_tokens=1)  # -> replica 0 (both idle, one session each)
    await turn(service, long_, [t % 250 for t in range(300)], max_tokens=1)  # -> replica 1
    assert [replicas.home(s) for s in (busy, other, short, long_)] == [0, 1, 0, 1]

    hog = asyncio.create_task(turn(service, busy, [7], max_tokens=3000))  # replica 0 busy for a while
    await until(lambda: replicas.engines[0].in_flight() > 0)
    moved = await turn(service, short, [8])
    assert replicas.home(short) == 1 and moved.cached_tokens == 0  # re-prefilled on the idle replica
    hog.cancel()
    await asyncio.gather(hog, return_exceptions=True)
    await until(lambda: replicas.engines[0].in_flight() == 0)
    # now replica 0 is idle and replica 1 busy: a session of 256 tokens or more stays where its cache is
    hog = asyncio.create_task(turn(service, other, [7], max_tokens=3000))
    await until(lambda: replicas.engines[1].in_flight() > 0)
    length = len(await service.dump(long_))
    stayed = await turn(service, long_, [9])
    assert replicas.home(long_) == 1 and stayed.cached_tokens == length - 1
    assert replicas.engines[0].in_flight() == 0  # it did not go to the idle replica
    hog.cancel()
    await asyncio.gather(hog, return_exceptions=True)
