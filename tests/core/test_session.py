"""The in-process store (idle expiry on a fake clock) and Session rules, pure Python.

The rules every store keeps are checked against each backend in tests/scale/test_store_contract.py.
"""

from __future__ import annotations

import pytest

from prismgate.core.errors import Code, GatewayError
from prismgate.core.session import ImageSpan, Session
from prismgate.core.stores import InProcessStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(**kw: object) -> tuple[InProcessStore, Clock]:
    clock = Clock()
    return InProcessStore(clock=clock, **kw), clock  # type: ignore[arg-type]


async def seeded(s: InProcessStore, tokens: list[int]) -> Session:
    session = await s.create("m")
    async with s.generation(session.id) as held:
        held.tokens = list(tokens)
    return session


async def test_create_get_close_is_idempotent() -> None:
    s, _ = store()
    sess = await seeded(s, [1, 2, 3])
    assert (await s.get(sess.id)).tokens == [1, 2, 3]
    assert await s.close(sess.id) is True
    assert await s.close(sess.id) is False
    with pytest.raises(GatewayError) as e:
        await s.get(sess.id)
    assert e.value.code is Code.NOT_FOUND


async def test_unknown_session_is_not_found_with_its_id() -> None:
    s, _ = store()
    with pytest.raises(GatewayError) as e:
        await s.get("nope")
    assert e.value.code is Code.NOT_FOUND and "'nope'" in e.value.message


async def test_idle_sessions_are_evicted_after_the_ttl_and_use_refreshes() -> None:
    s, clock = store(ttl_s=60)
    released: list[str] = []
    s.on_release(released.append)
    a = await s.create("m")
    b = await s.create("m")
    clock.now += 50
    await s.get(a.id)  # refreshes a
    clock.now += 20  # b idle 70 s, a idle 20 s
    assert await s.evict_expired() == [b.id]
    assert released == [b.id]
    assert a.id in s and b.id not in s


async def test_busy_sessions_are_not_evicted() -> None:
    s, clock = store(ttl_s=10)
    a = await s.create("m")
    async with s.generation(a.id):
        clock.now += 100
        assert await s.evict_expired() == []
    assert await s.evict_expired() == []  # a generation's end is a use: the idle time starts there
    clock.now += 11
    assert await s.evict_expired() == [a.id]


async def test_default_ttl_is_thirty_minutes() -> None:
    assert InProcessStore().ttl_s == 1800


async def test_session_cap() -> None:
    s, _ = store(max_sessions=2)
    await s.create("m")
    await s.create("m")
    with pytest.raises(GatewayError) as e:
        await s.create("m")
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "limit 2" in e.value.message


async def test_expired_sessions_free_capacity() -> None:
    s, clock = store(max_sessions=1, ttl_s=5)
    await s.create("m")
    clock.now += 6
    await s.create("m")  # the expired one was evicted to make room
    assert len(s) == 1


async def test_token_cap_counts_all_sessions() -> None:
    s, _ = store(max_total_tokens=10)
    await seeded(s, list(range(6)))
    with pytest.raises(GatewayError) as e:
        await s.reserve(5)
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "limit of 10" in e.value.message
    await s.reserve(4)  # exactly at the limit is fine


async def test_second_generation_on_a_busy_session_is_aborted() -> None:
    s, _ = store()
    a = await s.create("m")
    async with s.generation(a.id):
        with pytest.raises(GatewayError) as e:
            async with s.generation(a.id):
                pass
        assert e.value.code is Code.ABORTED
        assert a.busy
    assert not a.busy


async def test_fork_copies_prefix_and_whole_images() -> None:
    s, _ = store()
    a = await seeded(s, list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"img1", "image/png"), ImageSpan.of(10, 15, b"img2", "image/png")]
    child = await s.fork(a.id, 10)
    assert child.tokens == list(range(10))
    assert [im.start for im in child.images] == [2]
    assert child.id != a.id and a.tokens == list(range(20))
    child.tokens.append(99)
    assert a.tokens == list(range(20))  # independent timelines


@pytest.mark.parametrize("at", [3, 5, 11, 14])
async def test_fork_inside_an_image_block_is_refused(at: int) -> None:
    s, _ = store()
    a = await seeded(s, list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"x", "image/png"), ImageSpan.of(10, 15, b"y", "image/png")]
    with pytest.raises(GatewayError) as e:
        await s.fork(a.id, at)
    assert e.value.code is Code.FAILED_PRECONDITION and "inside the image block" in e.value.message


@pytest.mark.parametrize("at", [0, 2, 6, 10, 15, 20])
async def test_fork_at_image_boundaries_is_fine(at: int) -> None:
    s, _ = store()
    a = await seeded(s, list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"x", "image/png"), ImageSpan.of(10, 15, b"y", "image/png")]
    assert len((await s.fork(a.id, at)).tokens) == at


async def test_fork_past_the_end_is_refused() -> None:
    s, _ = store()
    a = await seeded(s, [1, 2])
    with pytest.raises(GatewayError) as e:
        await s.fork(a.id, 3)
    assert e.value.code is Code.FAILED_PRECONDITION and "past the session length 2" in e.value.message


async def test_truncate_rewinds_and_drops_later_images() -> None:
    s, _ = store()
    a = await seeded(s, list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"x", "image/png"), ImageSpan.of(10, 15, b"y", "image/png")]
    a.truncate(8)
    assert a.tokens == list(range(8)) and len(a.images) == 1
    with pytest.raises(GatewayError):
        a.truncate(4)
