"""The rules every session store keeps, checked against each backend (Redis: a real server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prismgate.core.errors import Code, GatewayError
from prismgate.core.session import ImageSpan, Session
from prismgate.core.steering import Comparison, Gate, Positions, SteeredSpan, SteeringEntry
from prismgate.core.stores import InProcessStore, SessionStore
from prismgate.core.stores.redis_store import RedisStore
from tests.scale.conftest import RedisServer, free_port

IMAGES = [ImageSpan.of(2, 6, b"\x89PNG one", "image/png"), ImageSpan.of(10, 15, b"\xff\xd8 two", "image/jpeg")]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SessionStore]:
    kw: dict[str, Any] = {"max_sessions": 3, "max_total_tokens": 100}
    if request.param == "memory":
        made: SessionStore = InProcessStore(**kw)
    else:
        server: RedisServer = request.getfixturevalue("redis")
        made = RedisStore(server.url, lock_s=2.0, **kw)
    yield made
    await made.close_all()


async def seeded(store: SessionStore, tokens: list[int], images: list[ImageSpan] | None = None) -> Session:
    """A session holding ``tokens`` (and ``images``): written the only way a client can, by a generation."""
    session = await store.create("m")
    async with store.generation(session.id) as held:
        held.tokens = list(tokens)
        held.images = list(images or [])
    return session


async def test_a_generation_saves_its_timeline_and_images(store: SessionStore) -> None:
    session = await seeded(store, list(range(20)), IMAGES)
    got = await store.get(session.id)
    assert got.model == "m" and got.tokens == list(range(20)) and not got.busy
    assert got.images == IMAGES  # bytes, mime and digest all round-trip
    async with store.generation(session.id) as held:
        held.truncate(10)
        held.tokens += [7, 8]
    got = await store.get(session.id)
    assert got.tokens == [*range(10), 7, 8] and got.images == IMAGES[:1]


async def test_close_is_idempotent_and_then_not_found(store: SessionStore) -> None:
    released: list[str] = []
    store.on_release(released.append)
    session = await seeded(store, [1, 2, 3])
    assert await store.close(session.id) is True
    assert await store.close(session.id) is False
    assert released[:1] == [session.id]
    for call in (store.get(session.id), store.fork(session.id, 0)):
        with pytest.raises(GatewayError) as e:
            await call
        assert e.value.code is Code.NOT_FOUND and repr(session.id) in e.value.message
    with pytest.raises(GatewayError) as e:
        async with store.generation(session.id):
            pass
    assert e.value.code is Code.NOT_FOUND


async def test_one_generation_per_session(store: SessionStore) -> None:
    session = await seeded(store, [1, 2])
    async with store.generation(session.id):
        assert (await store.get(session.id)).busy
        with pytest.raises(GatewayError) as e:
            async with store.generation(session.id):
                pass
        assert e.value.code is Code.ABORTED and "busy" in e.value.message
    assert not (await store.get(session.id)).busy
    async with store.generation(session.id):  # free again
        pass


async def test_a_failed_generation_releases_the_session(store: SessionStore) -> None:
    session = await seeded(store, [1, 2])
    with pytest.raises(RuntimeError):
        async with store.generation(session.id) as held:
            held.tokens.append(3)
            held.restore(([1, 2], []))  # what the core does for an unfinished atomic turn
            raise RuntimeError("the engine failed")
    got = await store.get(session.id)
    assert got.tokens == [1, 2] and not got.busy


async def test_fork_copies_the_prefix_and_whole_images(store: SessionStore) -> None:
    parent = await seeded(store, list(range(20)), IMAGES)
    child = await store.fork(parent.id, 10)
    got = await store.get(child.id)
    assert got.tokens == list(range(10)) and got.images == IMAGES[:1] and child.id != parent.id
    with pytest.raises(GatewayError) as e:
        await store.fork(parent.id, 12)
    assert e.value.code is Code.FAILED_PRECONDITION and "inside the image block" in e.value.message
    async with store.generation(child.id) as held:
        held.tokens.append(99)
    assert (await store.get(parent.id)).tokens == list(range(20))  # independent timelines


async def test_the_steering_record_is_stored_and_kept_in_step(store: SessionStore) -> None:
    """What each span was computed under survives a save and a reload (another replica's view), fork and truncate."""
    record = (SteeredSpan(0, 4, "a" * 16), SteeredSpan(4, 6, ""))
    parent = await store.create("m")
    async with store.generation(parent.id) as held:
        held.tokens = [1, 2, 3, 4, 5, 6]
        held.steering = record
    assert (await store.get(parent.id)).steering == record
    child = await store.fork(parent.id, 5)
    assert (await store.get(child.id)).steering == (SteeredSpan(0, 4, "a" * 16), SteeredSpan(4, 5, ""))
    async with store.generation(parent.id) as held:
        held.truncate(2)
    assert (await store.get(parent.id)).steering == (SteeredSpan(0, 2, "a" * 16),)
    async with store.generation(parent.id) as held:  # a change of steering alone is saved too
        held.steering = (SteeredSpan(0, 2, ""),)
    assert (await store.get(parent.id)).steering == (SteeredSpan(0, 2, ""),)


async def test_the_standing_steering_is_stored_forked_and_cleared(store: SessionStore) -> None:
    """A session's steering for later turns survives a reload (another replica's view) and a fork."""
    standing = (
        SteeringEntry(layer=0, scale=-2.5, concept="french", norm_match=True, positions=Positions.GENERATED),
        SteeringEntry(layer=3, scale=60.0, direction=(0.5, -1.25, 3.0)),
        SteeringEntry(layer=3, scale=4.0, concept="french", gate=Gate("french", 1, Comparison.BELOW, -0.75)),
        SteeringEntry(layer=2, scale=0.0, feature=9, clamp=-3.5, gate=Gate(None, 1, Comparison.ABOVE, 0.5, feature=4)),
        SteeringEntry(layer=2, scale=8.0, feature=4095, positions=Positions.PROMPT),
    )
    parent = await store.create("m")
    assert (await store.get(parent.id)).standing_steering == ()
    async with store.generation(parent.id) as held:  # a change of standing steering alone is saved
        held.standing_steering = standing
    assert (await store.get(parent.id)).standing_steering == standing
    child = await store.fork(parent.id, 0)
    assert (await store.get(child.id)).standing_steering == standing
    async with store.generation(parent.id) as held:
        held.standing_steering = ()
    assert (await store.get(parent.id)).standing_steering == ()
    assert (await store.get(child.id)).standing_steering == standing


async def test_session_and_token_caps(store: SessionStore) -> None:
    await seeded(store, list(range(60)))
    await store.create("m")
    await store.create("m")
    with pytest.raises(GatewayError) as e:
        await store.create("m")
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "limit 3" in e.value.message
    await store.reserve(40)  # exactly at the limit is fine
    with pytest.raises(GatewayError) as e:
        await store.reserve(41)
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "limit of 100" in e.value.message
    await store.evict_expired()
    assert len(store) == 3 and store.total_tokens == 60  # what the metrics read


# -- Redis only --------------------------------------------------------------------------------


async def test_redis_expiry_is_the_session_ttl(redis: RedisServer) -> None:
    store = RedisStore(redis.url, ttl_s=0.5)
    try:
        session = await seeded(store, [1, 2, 3])
        ttl_ms = int(redis.cli("pttl", f"prismgate:s:{session.id}"))
        assert 0 < ttl_ms <= 500
        await asyncio.sleep(0.3)
        await store.get(session.id)  # a use renews the expiry
        await asyncio.sleep(0.3)
        assert (await store.get(session.id)).tokens == [1, 2, 3]
        await asyncio.sleep(0.7)
        with pytest.raises(GatewayError) as e:
            await store.get(session.id)
        assert e.value.code is Code.NOT_FOUND
        await store.evict_expired()
        assert len(store) == 0 and store.total_tokens == 0
    finally:
        await store.close_all()


async def test_a_live_generation_renews_its_lock_and_the_session(redis: RedisServer) -> None:
    store = RedisStore(redis.url, ttl_s=0.6, lock_s=0.3)
    try:
        session = await seeded(store, [1])
        async with store.generation(session.id) as held:
            await asyncio.sleep(1.2)  # four lock periods, two TTLs
            held.tokens.append(2)
        assert (await store.get(session.id)).tokens == [1, 2]
    finally:
        await store.close_all()


async def test_a_generation_whose_lock_was_lost_is_aborted_and_not_saved(redis: RedisServer) -> None:
    """Another replica took the session after this one's lock expired: the late save must not win."""
    store = RedisStore(redis.url, lock_s=5.0)
    try:
        session = await seeded(store, [1])
        with pytest.raises(GatewayError) as e:
            async with store.generation(session.id) as held:
                redis.cli("set", f"prismgate:s:{session.id}:lock", "another replica's token")
                held.tokens.append(2)
        assert e.value.code is Code.ABORTED and "not saved" in e.value.message
        assert (await store.get(session.id)).tokens == [1]
    finally:
        await store.close_all()


async def test_redis_down_is_unavailable() -> None:
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1.0)
    try:
        sid = "0" * 32  # well formed: a malformed id is NOT_FOUND without asking Redis
        calls = [store.create("m"), store.get(sid), store.close(sid), store.reserve(1), store.evict_expired()]
        for call in calls:
            with pytest.raises(GatewayError) as e:
                await call
            assert e.value.code is Code.UNAVAILABLE and "session store (Redis)" in e.value.message
        with pytest.raises(GatewayError) as e:
            async with store.generation(sid):
                pass
        assert e.value.code is Code.UNAVAILABLE
    finally:
        await store.close_all()


async def test_an_id_no_session_can_have_is_not_found_never_another_key(store: SessionStore) -> None:
    """``<S>:lock`` while S generates names S's lock in Redis: NOT_FOUND, never WRONGTYPE/INTERNAL."""
    session = await seeded(store, [1, 2])
    async with store.generation(session.id):
        for bad in (f"{session.id}:lock", f"{session.id}:img", "*", "x" * 1_000_000):
            for call in (store.get(bad), store.fork(bad, 0)):
                with pytest.raises(GatewayError) as e:
                    await call
                assert e.value.code is Code.NOT_FOUND, e.value
                assert len(e.value.message) < 400  # a long id is quoted in part
            with pytest.raises(GatewayError) as e:
                async with store.generation(bad):
                    pass
            assert e.value.code is Code.NOT_FOUND, e.value
            assert await store.close(bad) is False
    assert (await store.get(session.id)).tokens == [1, 2]
