"""Two real ``prismgate serve`` processes sharing one real redis-server.

The sessions live in Redis, so any replica serves any call of any session: the
accounting stays exact when calls alternate, a killed replica loses nothing, one
generation per session holds across replicas, and Redis down is UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from prismgate.schemas import salience_pb2 as pb
from tests.ops.helpers import Served, serve
from tests.salience.conftest import Client, connect, rpc_error
from tests.scale.conftest import RedisServer, start_redis

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]


@contextlib.contextmanager
def replica(tmp_path: Path, model_dir: Path, store_url: str, name: str, *args: str) -> Iterator[tuple[Served, Client]]:
    """One ``prismgate serve`` on the shared store (``args``: more flags), and a Salience client to it."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    with serve(folder, model_dir, "--session-store", store_url, *args) as served:
        client = connect(served.grpc_target)
        try:
            yield served, client
        finally:
            client.channel.close()


@pytest.fixture
def two(tmp_path: Path, long_model_dir: Path, redis: RedisServer) -> Iterator[tuple[Client, Client]]:
    with (
        replica(tmp_path, long_model_dir, redis.url, "a") as (_, a),
        replica(tmp_path, long_model_dir, redis.url, "b") as (_, b),
    ):
        yield a, b


def turn(client: Client, sid: str, timeline: list[int], append: list[int], max_tokens: int) -> None:
    """One Generate at the client's own offset; the client's timeline takes the append and what came back."""
    tokens, done = client.generate(
        session_id=sid, append_tokens=append, offset=len(timeline), max_tokens=max_tokens, top_k=1
    )
    decoded = [t.id for t in tokens if not t.is_prefill]
    assert done.completion_tokens == len(decoded) == max_tokens
    assert done.prompt_tokens == len(timeline) + len(append)
    timeline += append + decoded


def test_a_conversation_alternating_between_replicas_keeps_exact_accounting(two: tuple[Client, Client]) -> None:
    a, b = two
    sid = a.open()
    timeline: list[int] = []
    for i, client in enumerate([b, a, b, a, b, a]):
        turn(client, sid, timeline, [20 + i, 30 + i], max_tokens=3 + i)
        assert a.dump(sid) == b.dump(sid) == timeline
    # the offset check holds across replicas: a client one turn behind is refused on either
    for client in (a, b):
        error = rpc_error(client.generate, session_id=sid, append_tokens=[1], offset=len(timeline) - 1, max_tokens=1)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert a.dump(sid) == timeline
    child = b.salience.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=6)).session_id
    assert a.dump(child) == timeline[:6]
    a.salience.CloseSession(pb.CloseSessionRequest(session_id=sid))
    error = rpc_error(b.dump, sid)
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_killing_a_replica_and_restarting_it_loses_no_token(
    tmp_path: Path, long_model_dir: Path, redis: RedisServer
) -> None:
    timeline: list[int] = []
    with replica(tmp_path, long_model_dir, redis.url, "b") as (_, b):
        with replica(tmp_path, long_model_dir, redis.url, "a") as (served_a, a):
            sid = a.open()
            turn(a, sid, timeline, PROMPT, max_tokens=5)
            turn(b, sid, timeline, [40], max_tokens=2)
            turn(a, sid, timeline, [41], max_tokens=4)
            served_a.process.kill()  # no shutdown at all: SIGKILL
            served_a.process.wait(10)
        assert b.dump(sid) == timeline
        turn(b, sid, timeline, [42], max_tokens=3)
        with replica(tmp_path, long_model_dir, redis.url, "a-again") as (_, again):
            assert again.dump(sid) == timeline  # a fresh process, no KV cache: the session is whole
            turn(again, sid, timeline, [43], max_tokens=2)
        assert b.dump(sid) == timeline


def test_two_replicas_racing_a_generate_give_exactly_one_aborted(two: tuple[Client, Client]) -> None:
    a, b = two
    sid = a.open()
    start = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def race(name: str, client: Client) -> None:
        start.wait()
        try:
            tokens, _ = client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=200, top_k=1)
            outcomes[name] = [t.id for t in tokens if not t.is_prefill]
        except grpc.RpcError as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=race, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    errors = [o for o in outcomes.values() if isinstance(o, grpc.RpcError)]
    won = [o for o in outcomes.values() if isinstance(o, list)]
    assert len(errors) == 1 and len(won) == 1, outcomes
    assert errors[0].code() == grpc.StatusCode.ABORTED and "busy" in (errors[0].details() or "")
    assert len(won[0]) == 200
    assert a.dump(sid) == b.dump(sid) == PROMPT + won[0]  # the loser left no trace


def test_redis_down_is_unavailable_never_a_wrong_answer(
    tmp_path: Path, long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    store = start_redis(tmp_path_factory.mktemp("redis-down"))
    try:
        with replica(tmp_path, long_model_dir, store.url, "a") as (served, a):
            sid = a.open()
            timeline: list[int] = []
            turn(a, sid, timeline, PROMPT, max_tokens=2)
            assert httpx.get(served.http_url + "/readyz", timeout=10).status_code == 200
            for bad in (sid + ":lock", sid + ":img"):  # another key of the session in Redis: NOT_FOUND
                error = rpc_error(lambda bad=bad: a.dump(bad, timeout=20))
                assert error.code() == grpc.StatusCode.NOT_FOUND, error
            store.stop()
            time.sleep(1.1)  # readiness asks Redis at most once a second
            ready = httpx.get(served.http_url + "/readyz", timeout=20)
            assert ready.status_code == 503 and "session store (Redis)" in ready.json()["reason"], ready.text
            for call in (
                lambda: a.open(timeout=20),
                lambda: a.dump(sid, timeout=20),
                lambda: a.generate(session_id=sid, append_tokens=[1], offset=len(timeline), max_tokens=1),
            ):
                error = rpc_error(call)
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert "session store (Redis)" in (error.details() or "")
    finally:
        store.stop()


def test_a_cancelled_generation_frees_the_session_for_the_other_replica(two: tuple[Client, Client]) -> None:
    a, b = two
    sid = a.open()
    call = a.salience.Generate(
        pb.GenerateRequest(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=400, top_k=1)
    )
    received = [next(call) for _ in range(len(PROMPT) + 2)]  # the prefill and two decoded tokens
    assert [e.token.is_prefill for e in received][-2:] == [False, False]
    call.cancel()
    deadline = time.monotonic() + 5  # half the lock's 10 s
    while True:  # the cancelled stream's session is released at once, not after its lock expires
        try:
            _, done = b.generate(session_id=sid, append_tokens=[9], offset=len(PROMPT), max_tokens=1, top_k=1)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.ABORTED and time.monotonic() < deadline, exc
            time.sleep(0.05)
    assert done.prompt_tokens == len(PROMPT) + 1  # the append stayed, the decoded tokens did not
    assert a.dump(sid)[: len(PROMPT) + 1] == [*PROMPT, 9]
