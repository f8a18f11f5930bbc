"""SessionStore and Session rules, pure Python."""

from __future__ import annotations

import pytest

from prismgate.core.errors import Code, GatewayError
from prismgate.core.session import ImageSpan, SessionStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(**kw: object) -> tuple[SessionStore, Clock]:
    clock = Clock()
    return SessionStore(clock=clock, **kw), clock  # type: ignore[arg-type]


def test_create_get_close_is_idempotent() -> None:
    s, _ = store()
    sess = s.create("m", [1, 2, 3])
    assert s.get(sess.id).tokens == [1, 2, 3]
    assert s.close(sess.id) is True
    assert s.close(sess.id) is False
    with pytest.raises(GatewayError) as e:
        s.get(sess.id)
    assert e.value.code is Code.NOT_FOUND


def test_unknown_session_is_not_found_with_its_id() -> None:
    s, _ = store()
    with pytest.raises(GatewayError) as e:
        s.get("nope")
    assert e.value.code is Code.NOT_FOUND and "'nope'" in e.value.message


def test_idle_sessions_are_evicted_after_the_ttl_and_use_refreshes() -> None:
    s, clock = store(ttl_s=60)
    released: list[str] = []
    s.on_release(released.append)
    a = s.create("m")
    b = s.create("m")
    clock.now += 50
    s.get(a.id)  # refreshes a
    clock.now += 20  # b idle 70 s, a idle 20 s
    assert s.evict_expired() == [b.id]
    assert released == [b.id]
    assert a.id in s and b.id not in s


def test_busy_sessions_are_not_evicted() -> None:
    s, clock = store(ttl_s=10)
    a = s.create("m")
    with a.generation():
        clock.now += 100
        assert s.evict_expired() == []
    assert s.evict_expired() == [a.id]


def test_default_ttl_is_thirty_minutes() -> None:
    assert SessionStore().ttl_s == 1800


def test_session_cap() -> None:
    s, _ = store(max_sessions=2)
    s.create("m")
    s.create("m")
    with pytest.raises(GatewayError) as e:
        s.create("m")
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "limit 2" in e.value.message


def test_expired_sessions_free_capacity() -> None:
    s, clock = store(max_sessions=1, ttl_s=5)
    s.create("m")
    clock.now += 6
    s.create("m")  # the expired one was evicted to make room
    assert len(s) == 1


def test_token_cap_counts_all_sessions() -> None:
    s, _ = store(max_total_tokens=10)
    s.create("m", list(range(6)))
    with pytest.raises(GatewayError) as e:
        s.create("m", list(range(5)))
    assert e.value.code is Code.RESOURCE_EXHAUSTED and "limit of 10" in e.value.message
    s.reserve(4)  # exactly at the limit is fine


def test_second_generation_on_a_busy_session_is_aborted() -> None:
    s, _ = store()
    a = s.create("m")
    with a.generation():
        with pytest.raises(GatewayError) as e, a.generation():
            pass
        assert e.value.code is Code.ABORTED
        assert a.busy
    assert not a.busy


def test_fork_copies_prefix_and_whole_images() -> None:
    s, _ = store()
    a = s.create("m", list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"img1", "image/png"), ImageSpan.of(10, 15, b"img2", "image/png")]
    child = s.fork(a.id, 10)
    assert child.tokens == list(range(10))
    assert [im.start for im in child.images] == [2]
    assert child.id != a.id and a.tokens == list(range(20))
    child.tokens.append(99)
    assert a.tokens == list(range(20))  # independent timelines


@pytest.mark.parametrize("at", [3, 5, 11, 14])
def test_fork_inside_an_image_block_is_refused(at: int) -> None:
    s, _ = store()
    a = s.create("m", list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"x", "image/png"), ImageSpan.of(10, 15, b"y", "image/png")]
    with pytest.raises(GatewayError) as e:
        s.fork(a.id, at)
    assert e.value.code is Code.FAILED_PRECONDITION and "inside the image block" in e.value.message


@pytest.mark.parametrize("at", [0, 2, 6, 10, 15, 20])
def test_fork_at_image_boundaries_is_fine(at: int) -> None:
    s, _ = store()
    a = s.create("m", list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"x", "image/png"), ImageSpan.of(10, 15, b"y", "image/png")]
    assert len(s.fork(a.id, at).tokens) == at


def test_fork_past_the_end_is_refused() -> None:
    s, _ = store()
    a = s.create("m", [1, 2])
    with pytest.raises(GatewayError) as e:
        s.fork(a.id, 3)
    assert e.value.code is Code.FAILED_PRECONDITION and "past the session length 2" in e.value.message


def test_truncate_rewinds_and_drops_later_images() -> None:
    s, _ = store()
    a = s.create("m", list(range(20)))
    a.images = [ImageSpan.of(2, 6, b"x", "image/png"), ImageSpan.of(10, 15, b"y", "image/png")]
    a.truncate(8)
    assert a.tokens == list(range(8)) and len(a.images) == 1
    with pytest.raises(GatewayError):
        a.truncate(4)
