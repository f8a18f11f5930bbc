"""A deterministic session continued on a second replica after the first one died: the same bits.

Two real ``prismgate serve`` processes share one real redis-server. A deterministic Salience
session's first turn runs on replica A, its second on replica B (which prefills the first turn
and keeps the keys and values of the tokens it decodes); A is killed (SIGKILL); the third turn
runs on B, over its cache. That turn's token ids, logprobs, top logprobs and readouts equal, to
the bit, what a fresh session sent the whole timeline at once gets on B, and A's first turn
equals the same request run fresh on B: nothing depends on which process computed what.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prismgate.codecs.salience import convert
from prismgate.schemas import salience_pb2 as pb
from tests.salience.conftest import Client, connect, ranges
from tests.scale.conftest import RedisServer
from tests.serve_process import Served, serve_process
from tests.tiny_model import build_random_pack

pytestmark = pytest.mark.slow

DETERMINISTIC = [(convert.DETERMINISTIC_KEY, "true")]


@contextlib.contextmanager
def replica(folder: Path, model_dir: Path, pack: Path, store_url: str) -> Iterator[tuple[Served, Client]]:
    folder.mkdir(exist_ok=True)
    args = ("--model", str(model_dir), "--model-name", "tiny-llama", "--concept-pack", str(pack))
    with serve_process(folder, *args, "--session-store", store_url, timeout=120.0) as served:
        client = connect(served.grpc_target)
        try:
            yield served, client
        finally:
            client.channel.close()


def bits(tokens: list[pb.Token]) -> list[tuple[Any, ...]]:
    return [
        (t.id, t.position, t.sampled_logprob, tuple((a.id, a.logprob) for a in t.logprobs), tuple(t.readout))
        for t in tokens
    ]


def generate(client: Client, sid: str, offset: int, append: list[int], max_tokens: int) -> list[pb.Token]:
    end = offset + len(append) + max_tokens
    tokens, done = client.generate(
        session_id=sid,
        append_tokens=append,
        offset=offset,
        max_tokens=max_tokens,
        top_k=1,
        logprobs_ranges=ranges((offset + len(append), end)),
        logprob_top_k=4,
        readout_ranges=ranges((offset + len(append) - 1, end)),
        metadata=DETERMINISTIC,
    )
    assert done.completion_tokens == max_tokens
    return tokens


def decoded(tokens: list[pb.Token]) -> list[int]:
    return [t.id for t in tokens if not t.is_prefill]


def test_a_deterministic_session_continued_on_another_replica_gives_the_same_bits(
    tmp_path: Path, long_model_dir: Path, redis: RedisServer
) -> None:
    (tmp_path / "pack").mkdir()
    pack = build_random_pack(tmp_path / "pack", long_model_dir)
    first, second, third = [5, 6, 7, 8, 9], [20, 21, 22], [30, 31]
    with replica(tmp_path / "b", long_model_dir, pack, redis.url) as (_, b):
        with replica(tmp_path / "a", long_model_dir, pack, redis.url) as (served_a, a):
            sid = a.open()
            on_a = generate(a, sid, 0, first, 6)
            timeline = first + decoded(on_a)
            timeline += second + decoded(generate(b, sid, len(timeline), second, 4))  # B keeps decoded KV
            served_a.process.kill()  # no shutdown at all: SIGKILL
            served_a.process.wait(10)
        assert bits(generate(b, b.open(), 0, first, 6)) == bits(on_a)  # another process, the same bits
        continued = generate(b, sid, len(timeline), third, 5)
        fresh = generate(b, b.open(), 0, timeline + third, 5)
        assert bits(continued) == bits(fresh)
        assert all(t.readout for t in continued)  # readouts were compared, not absent
