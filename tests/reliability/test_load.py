"""Load: many concurrent sessions on all three protocols for a fixed time, on loopback.

Salience, Evergreen (WebSocket) and GraphPipe clients run side by side for ``LOAD_S``
seconds (``PRISMGATE_LOAD_S``, default 15) against one gateway. Every turn is checked
against the client's own accounting: Salience sessions end with DumpSession equal to the
timeline the client built from what it sent and received; Evergreen follow-ups reuse exactly
the previous turn's tokens; GraphPipe lengths match the tokens returned. No request may
fail, the server's RSS may grow by at most ``RSS_BOUND`` over the run (after a warm-up),
and afterwards no session, engine request or KV cache is left behind.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import websockets
from graphpipe import convert

from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer, tiny_settings
from tests.reliability.conftest import run_gateway, wait_engine_idle, wait_until

pytestmark = pytest.mark.slow

LOAD_S = float(os.environ.get("PRISMGATE_LOAD_S", "15"))
RSS_BOUND = 96 * 1024 * 1024  # bytes the process may grow by under load, after a warm-up
SALIENCE_WORKERS, EVERGREEN_WORKERS, GRAPHPIPE_WORKERS = 6, 4, 2
CONTEXT = 512
STRUCT = "type.googleapis.com/google.protobuf.Struct"


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def load_server(tiny_model_dir: Path, tiny_pack: Path) -> Iterator[LiveServer]:
    settings = tiny_settings(tiny_model_dir, tiny_pack, max_cached_tokens=1 << 15)
    with run_gateway(settings) as server:
        yield server


class Tally:
    def __init__(self) -> None:
        self.turns: dict[str, int] = {"salience": 0, "evergreen": 0, "graphpipe": 0}
        self.sessions_checked = 0
        self.errors: list[str] = []


async def salience_worker(target: str, deadline: float, rng: random.Random, tally: Tally) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        while time.monotonic() < deadline:
            sid = (await stub.OpenSession(spb.OpenSessionRequest(model=TINY_MODEL_ID))).session_id
            timeline: list[int] = []
            while time.monotonic() < deadline and len(timeline) < CONTEXT - 64:
                append = [rng.randrange(32, 127) for _ in range(rng.randint(2, 12))]
                max_tokens = rng.randint(2, 16)
                request = spb.GenerateRequest(
                    session_id=sid, offset=len(timeline), append_tokens=append, max_tokens=max_tokens, top_k=1
                )
                ids: list[int] = []
                done = None
                async for event in stub.Generate(request):
                    if event.HasField("token"):
                        ids.append(event.token.id)
                    else:
                        done = event.done
                assert done is not None and done.completion_tokens == len(ids) <= max_tokens
                assert done.prompt_tokens == len(timeline) + len(append)
                timeline += append + ids
                tally.turns["salience"] += 1
            dumped = list((await stub.DumpSession(spb.DumpSessionRequest(session_id=sid))).tokens)
            assert dumped == timeline, (
                f"session {sid}: server holds {len(dumped)} tokens, client counted {len(timeline)}"
            )
            tally.sessions_checked += 1
            await stub.CloseSession(spb.CloseSessionRequest(session_id=sid))


def evergreen_turn(turn: int, question: str) -> str:
    children = [x for t in range(turn) for x in (f"q{t}", f"r{t}")] + [f"q{turn}"]
    return json.dumps(
        {
            "actions": [
                {
                    "name": "GENERATE",
                    "inputs": [{"name": "prompt", "id": f"p{turn}"}],
                    "outputs": [{"name": "response", "id": f"r{turn}"}, {"name": "usage", "id": f"u{turn}"}],
                    "configs": [{"@type": STRUCT, "value": {"maxTokens": 8, "ignoreEos": True}}],
                }
            ],
            "nodeFragments": [
                {"id": f"p{turn}", "childIds": children},
                {
                    "id": f"q{turn}",
                    "chunkFragment": {
                        "metadata": {"mimetype": "text/plain", "role": "user"},
                        "data": base64.b64encode(question.encode()).decode(),
                    },
                },
            ],
        }
    )


async def evergreen_worker(url: str, deadline: float, rng: random.Random, tally: Tally) -> None:
    while time.monotonic() < deadline:
        async with websockets.connect(url, max_size=None) as ws:
            previous_total = 0
            for turn in range(12):
                if time.monotonic() >= deadline:
                    break
                await ws.send(evergreen_turn(turn, "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 20)))))
                usage: dict[str, Any] | None = None
                async with asyncio.timeout(60):
                    while usage is None:
                        for f in json.loads(await ws.recv()).get("nodeFragments", []):
                            data = f.get("chunkFragment", {}).get("data")
                            if f["id"] == f"u{turn}" and data:
                                usage = json.loads(base64.b64decode(data))
                assert usage["completionTokens"] == 8 and usage["finishReason"] == "length", usage
                if turn:  # the conversation so far is reused token for token
                    assert usage["reusedTokens"] == previous_total, (usage, previous_total)
                previous_total = usage["promptTokens"] + usage["completionTokens"]
                tally.turns["evergreen"] += 1
                if previous_total > CONTEXT - 96:
                    break
        tally.sessions_checked += 1


async def graphpipe_worker(url: str, deadline: float, rng: random.Random, tally: Tally) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        while time.monotonic() < deadline:
            rows = np.array([[rng.randrange(32, 127) for _ in range(8)] for _ in range(3)], dtype=np.int64)
            max_tokens = rng.randint(1, 12)
            body = bytes(
                convert.serialize_infer_request(
                    convert.InferReq(json.dumps({"max_tokens": max_tokens}), [rows], ["tokens"], ["tokens", "lengths"])
                )
            )
            response = await http.post(url, content=body)
            outputs, errors = convert.deserialize_infer_response(response.content)
            assert not errors, errors
            tokens, lengths = outputs
            assert tokens.shape[0] == 3 and all(0 < n <= max_tokens for n in lengths)
            for row, n in zip(tokens, lengths, strict=True):
                assert (row[:n] >= 0).all() and (row[n:] == -1).all()
            tally.turns["graphpipe"] += 1


async def run_load(server: LiveServer, seconds: float, seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    rng = random.Random(seed)

    async def guarded(name: str, coro: Any) -> None:
        try:
            await coro
        except Exception as exc:
            tally.errors.append(f"{name}: {type(exc).__name__}: {exc}")

    workers = [
        guarded(f"salience-{i}", salience_worker(server.grpc_target, deadline, random.Random(rng.random()), tally))
        for i in range(SALIENCE_WORKERS)
    ]
    workers += [
        guarded(
            f"evergreen-{i}",
            evergreen_worker(server.ws_url + "/evergreen", deadline, random.Random(rng.random()), tally),
        )
        for i in range(EVERGREEN_WORKERS)
    ]
    workers += [
        guarded(
            f"graphpipe-{i}",
            graphpipe_worker(server.http_url + "/graphpipe", deadline, random.Random(rng.random()), tally),
        )
        for i in range(GRAPHPIPE_WORKERS)
    ]
    await asyncio.gather(*workers)
    return tally


def test_mixed_load_no_errors_bounded_memory_exact_accounting(load_server: LiveServer) -> None:
    server = load_server
    engine = server.service.pool.engine()
    warm = asyncio.run(run_load(server, 3.0, seed=1))  # warm-up: first-call allocations, caches, pools
    assert not warm.errors, warm.errors
    gc.collect()
    before = rss()

    tally = asyncio.run(run_load(server, LOAD_S, seed=2))

    assert not tally.errors, tally.errors[:5]
    assert all(n > 0 for n in tally.turns.values()), tally.turns
    assert tally.sessions_checked >= SALIENCE_WORKERS + EVERGREEN_WORKERS
    assert wait_engine_idle(server), f"{engine.in_flight()} engine requests left"
    # a WebSocket's session closes on the server once it has seen the close, which a loaded
    # machine may do a moment after the client returned
    closed = wait_until(lambda: len(server.service.store) == 0, 10.0)
    assert closed, f"{len(server.service.store)} sessions left open"
    # every closed session released its KV cache in the engine (a private field: nothing public says)
    assert wait_until_released(engine), f"{len(engine._sessions)} KV caches left"
    gc.collect()
    grown = rss() - before
    print(f"load: {tally.turns} turns, {tally.sessions_checked} sessions checked, RSS {grown / 2**20:+.1f} MiB")
    assert grown < RSS_BOUND, f"RSS grew by {grown / 2**20:.1f} MiB under load (bound {RSS_BOUND / 2**20:.0f} MiB)"


def wait_until_released(engine: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine._sessions:
            return True
        time.sleep(0.05)
    return not engine._sessions
