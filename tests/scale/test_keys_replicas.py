"""Named keys across two real ``prismgate serve`` replicas sharing one real redis-server.

A session's owner is stored with it in Redis, so another key is told it does not exist on
either replica; a key's limits are counted in Redis, so two replicas enforce one limit; and
SIGHUP makes each replica read the keys file again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from prismgate.schemas import salience_pb2 as pb
from tests.ops.helpers import Served
from tests.ops.test_keys import KEYS, meta, write_keys
from tests.salience.conftest import Client, rpc_error
from tests.scale.conftest import RedisServer
from tests.scale.test_replicas import replica

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8]


@pytest.fixture
def two(
    tmp_path: Path, long_model_dir: Path, redis: RedisServer
) -> Iterator[tuple[tuple[Served, Client], tuple[Served, Client], Path]]:
    keys = tmp_path / "keys.toml"
    write_keys(keys, ["alice", "bob", "root", "slow", "single"])
    with (
        replica(tmp_path, long_model_dir, redis.url, "a", "--keys-file", str(keys)) as a,
        replica(tmp_path, long_model_dir, redis.url, "b", "--keys-file", str(keys)) as b,
    ):
        yield a, b, keys


def test_a_session_belongs_to_its_key_on_every_replica(two: tuple[tuple[Served, Client], ...]) -> None:
    (served_a, a), (served_b, b), _ = two
    # the OpenAI API's sessions: opened on a, another key's 404 on b, the owner's 200 on b
    opened = httpx.post(f"{served_a.http_url}/v1/sessions", json={}, headers=dict(meta("alice")), timeout=30)
    http_sid = opened.json()["id"]
    assert httpx.get(f"{served_b.http_url}/v1/sessions/{http_sid}", headers=dict(meta("bob"))).status_code == 404
    assert httpx.get(f"{served_b.http_url}/v1/sessions/{http_sid}", headers=dict(meta("alice"))).status_code == 200
    listed = httpx.get(f"{served_b.http_url}/v1/sessions", headers=dict(meta("root"))).json()["data"]
    assert {"id": http_sid, "object": "session", "owner": "alice"} in listed

    sid = a.open(metadata=meta("alice"))
    a.generate(session_id=sid, append_tokens=PROMPT, max_tokens=2, top_k=1, metadata=meta("alice"))
    for client in (a, b):
        for call in (
            lambda c=client: c.dump(sid, metadata=meta("bob")),
            lambda c=client: c.generate(session_id=sid, append_tokens=[1], max_tokens=1, metadata=meta("bob")),
            lambda c=client: c.salience.ForkSession(
                pb.ForkSessionRequest(session_id=sid, at_position=1), metadata=meta("bob")
            ),
        ):
            assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND
        client.salience.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=meta("bob"))
    assert len(b.dump(sid, metadata=meta("alice"))) == 6  # bob's closes on both replicas left it alone
    assert len(b.dump(sid, metadata=meta("root"))) == 6  # the admin scope, on the other replica
    b.salience.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=meta("root"))
    assert rpc_error(a.dump, sid, metadata=meta("alice")).code() == grpc.StatusCode.NOT_FOUND


def test_a_token_rate_used_up_on_one_replica_holds_on_the_other(two: tuple[tuple[Served, Client], ...]) -> None:
    (_, a), (_, b), _ = two
    sid = a.open(metadata=meta("slow"))
    a.generate(session_id=sid, append_tokens=PROMPT * 4, max_tokens=8, top_k=1, metadata=meta("slow"))  # 24 > 20
    other = b.open(metadata=meta("slow"))
    try:  # succeeds only when the minute turned since a's turn, which then used up the new window
        b.generate(session_id=other, append_tokens=PROMPT * 6, max_tokens=1, metadata=meta("slow"))
        other = b.open(metadata=meta("slow"))
    except grpc.RpcError:
        pass
    error = rpc_error(b.generate, session_id=other, append_tokens=PROMPT, max_tokens=1, metadata=meta("slow"))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute" in error.details()
    assert 1 <= int(dict(error.trailing_metadata() or ())["retry-after"]) <= 60
    b.generate(session_id=b.open(metadata=meta("bob")), append_tokens=PROMPT, max_tokens=1, metadata=meta("bob"))


def test_one_generation_at_a_time_across_replicas(two: tuple[tuple[Served, Client], ...]) -> None:
    (_, a), (_, b), _ = two
    long_sid, short_sid = a.open(metadata=meta("single")), b.open(metadata=meta("single"))
    started = threading.Event()
    outcome: list[object] = []

    def long_generation() -> None:
        request = pb.GenerateRequest(session_id=long_sid, append_tokens=PROMPT, max_tokens=400)
        events = a.salience.Generate(request, metadata=meta("single"), timeout=120)
        for event in events:
            started.set()
            outcome.append(event)

    thread = threading.Thread(target=long_generation)
    thread.start()
    try:
        assert started.wait(60)
        error = rpc_error(b.generate, session_id=short_sid, append_tokens=PROMPT, max_tokens=1, metadata=meta("single"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in error.details()
    finally:
        thread.join(120)
    assert outcome and outcome[-1].WhichOneof("event") == "done"
    b.generate(session_id=short_sid, append_tokens=PROMPT, max_tokens=1, metadata=meta("single"))  # its lease is free


def test_sighup_reads_the_keys_file_again_on_each_replica(two: tuple[tuple[Served, Client], ...]) -> None:
    (served_a, a), (served_b, b), keys = two
    before = keys.stat()
    carol_key = "k-carol-0123456789abcdef"
    write_keys(keys, ["alice"], {"carol": (carol_key, {})})
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same mtime: only the signal tells
    time.sleep(1.5)
    assert a.open(metadata=meta("bob"))  # not noticed yet
    for served in (served_a, served_b):
        served.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    for client in (a, b):
        while (error := _open_error(client, meta("bob"))) is None:
            assert time.monotonic() < deadline, "bob's key still works after SIGHUP"
            time.sleep(0.1)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert client.open(metadata=[("authorization", f"Bearer {carol_key}")])
    reloaded = [line for line in served_a.logs() if line.get("message") == "keys file reloaded"]
    assert (
        reloaded and reloaded[-1]["removed"] == ["bob", "root", "single", "slow"] and reloaded[-1]["added"] == ["carol"]
    )
    assert all(KEYS["bob"][0] not in line for line in served_a.log_lines())


def _open_error(client: Client, metadata: list[tuple[str, str]]) -> grpc.RpcError | None:
    try:
        client.open(metadata=metadata)
    except grpc.RpcError as exc:
        return exc
    return None
