"""A Salience session's steering lives in Redis: set on one replica, applied by another."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from prismgate.schemas import salience_steering_pb2 as steer_pb
from prismgate.schemas import salience_steering_pb2_grpc
from tests.ops.helpers import serve
from tests.salience.conftest import Client, connect
from tests.scale.conftest import RedisServer

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 7, 3]
PUSH = steer_pb.SteeringEntry(concept="concept1", layer=0, scale=60, positions=steer_pb.POSITIONS_BOTH)


@contextlib.contextmanager
def replica(tmp_path: Path, model_dir: Path, pack: Path, store_url: str, name: str) -> Iterator[Client]:
    folder = tmp_path / name
    folder.mkdir()
    with serve(folder, model_dir, "--session-store", store_url, "--concept-pack", str(pack)) as served:
        client = connect(served.grpc_target)
        try:
            yield client
        finally:
            client.channel.close()


def greedy(client: Client, session: str, offset: int, append: list[int]) -> list[int]:
    tokens, _ = client.generate(session_id=session, offset=offset, append_tokens=append, max_tokens=8, top_k=1)
    return [t.id for t in tokens if not t.is_prefill]


def test_steering_set_on_one_replica_steers_the_next_turn_on_the_other(
    tmp_path: Path, tiny_model_dir: Path, tiny_pack: Path, redis: RedisServer
) -> None:
    with (
        replica(tmp_path, tiny_model_dir, tiny_pack, redis.url, "a") as a,
        replica(tmp_path, tiny_model_dir, tiny_pack, redis.url, "b") as b,
    ):
        plain = greedy(b, b.open("tiny-llama"), 0, PROMPT)
        session = a.open("tiny-llama")
        set_on_a = salience_steering_pb2_grpc.SteeringStub(a.channel)
        set_on_a.SetSteering(steer_pb.SetSteeringRequest(session_id=session, entries=[PUSH]), timeout=10)
        on_b = salience_steering_pb2_grpc.SteeringStub(b.channel)
        assert list(on_b.GetSteering(steer_pb.GetSteeringRequest(session_id=session), timeout=10).entries) == [PUSH]
        steered = greedy(b, session, 0, PROMPT)
        assert steered != plain
        other = a.open("tiny-llama")
        set_on_a.SetSteering(steer_pb.SetSteeringRequest(session_id=other, entries=[PUSH]), timeout=10)
        assert greedy(a, other, 0, PROMPT) == steered  # what the replica that set it computes too
        on_b.SetSteering(steer_pb.SetSteeringRequest(session_id=session, entries=[]), timeout=10)
        tokens, _ = a.generate(
            session_id=session, offset=0, truncating=True, append_tokens=PROMPT, max_tokens=8, top_k=1
        )
        assert [t.id for t in tokens if not t.is_prefill] == plain
