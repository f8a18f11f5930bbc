"""Each class of issue 13's attacks (and issue 23's, rows 10-12) against a real gateway, with what a bystander sees.

    python -m bench.hostile            # about two minutes on 2 cores

Per attack, one row: the worst latency of a ``/healthz`` probe looping beside it, the worst
latency of a normal client (a two-token OpenAI completion, looping too), how many times
that client was served during the attack, and how much the process grew (RSS; the
gateway runs in this process, on its own thread, over real loopback sockets). The attacks
are bounded in count and time and only ever talk to 127.0.0.1.

The model is the tests' tiny Llama with a 4k context that never stops at EOS and a
256-concept pack (readouts of kilobytes per token), built once under ``build/bench``;
``--model smollm2`` runs the attacks on the embedded SmolLM2-135M-Instruct and its pack instead
(the figures issue 23 set its memory target on), with the default memory budget either way.

    python -m bench.hostile --only 10 --model smollm2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import requests
import websockets
from websockets.sync.client import connect as ws_connect

from bench.common import WORK, settings
from prismgate.core.budget import RequestBudget
from prismgate.schemas import salience_pb2 as spb
from prismgate.schemas import salience_pb2_grpc
from prismgate.thread_server import RunningGateway, serve_in_thread
from tests.evergreen.test_hostile import doubling_dag
from tests.evergreen.wire import generate, msg
from tests.graphpipe.helpers import infer_buffer
from tests.reliability.conftest import UnderAttack, wait_engine_idle
from tests.reliability.test_attacks import overflowing_shape_request
from tests.reliability.test_slow_readers import grpc_reader, sse_reader, websocket_reader

MODEL = "tiny-llama"
SLOW_CLIENT_TIMEOUT_S = 2.0
Attack = Callable[[RunningGateway], None]


def model_of(server: RunningGateway) -> str:
    """The name the gateway serves its model under."""
    return server.service.models.names[0]


def long_model() -> tuple[Path, Path]:
    from tests.tiny_model import build_eos_free_llama, build_random_pack

    folder = WORK / "tiny-llama-eos-free-4096"
    model_dir = folder / MODEL
    if not (model_dir / "config.json").exists():
        build_eos_free_llama(model_dir, max_len=4096)
    pack = folder / "tiny-pack.safetensors"
    if not pack.exists():
        build_random_pack(folder, model_dir, n_concepts=256)
    return model_dir, pack


# -- the attacks ---------------------------------------------------------------------------


async def _evergreen_until_closed(server: RunningGateway, frame: str) -> None:
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        await ws.send(frame)
        with contextlib.suppress(websockets.ConnectionClosed):
            async with asyncio.timeout(60):
                while True:
                    await ws.recv()


def amplification(server: RunningGateway) -> None:
    """An Evergreen DAG of 24 doubling levels (16.7 million leaves from 2 KB), three times."""
    frame = msg(actions=[generate("n24", "r")], fragments=doubling_dag(24))
    for _ in range(3):
        asyncio.run(_evergreen_until_closed(server, frame))


def quadratic(server: RunningGateway) -> None:
    """A GENERATE waiting on a node that never comes, then over a thousand DROPs, three times."""
    drops = [{"name": "DROP", "inputs": [{"name": "x", "id": "never"}]}] * (RequestBudget().max_actions_in_flight + 10)
    frame = msg(actions=[generate("never", "r"), *drops])
    for _ in range(3):
        asyncio.run(_evergreen_until_closed(server, frame))


def million_ranges(server: RunningGateway) -> None:
    """A Salience Generate with a million position ranges, twice."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sid = stub.OpenSession(spb.OpenSessionRequest(model=model_of(server))).session_id
        ranges = [spb.PositionRange(start=0, end=1)] * 1_000_000
        for _ in range(2):
            with contextlib.suppress(grpc.RpcError):
                list(stub.Generate(spb.GenerateRequest(session_id=sid, append_tokens=[1], logprobs_ranges=ranges)))


def huge_prompt(server: RunningGateway) -> None:
    """A 20 MB chat message, twice."""
    body = {"model": model_of(server), "messages": [{"role": "user", "content": "a " * (10 << 20)}]}
    for _ in range(2):
        httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=120)


def non_readers(server: RunningGateway) -> None:
    """One long streaming generation per protocol (SSE, WebSocket, gRPC) whose client never reads."""
    with contextlib.ExitStack() as clients:
        for reader in (sse_reader, websocket_reader, grpc_reader):
            clients.enter_context(reader(server, 3000))
        time.sleep(1)
        wait_engine_idle(server, 60)


def unfinished_requests(server: RunningGateway) -> None:
    """40 connections: half send half a head, half a head and part of a body; then wait for the 408s."""
    with contextlib.ExitStack() as stack:
        socks = [
            stack.enter_context(socket.create_connection(("127.0.0.1", server.gateway.http_port))) for _ in range(40)
        ]
        for i, sock in enumerate(socks):
            sock.sendall(
                b"GET /healthz HTTP/1.1\r\nX-Slow: "
                if i % 2
                else b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 900\r\n\r\n{"
            )
        for sock in socks:
            sock.settimeout(30)
            with contextlib.suppress(OSError):
                while sock.recv(65536):
                    pass


def idle_sessions(server: RunningGateway) -> None:
    """64 /evergreen connections that never send anything, held for two seconds."""
    with contextlib.ExitStack() as stack:
        for _ in range(64):
            stack.enter_context(ws_connect(server.ws_url + "/evergreen"))
        time.sleep(2)


def foreign_origins(server: RunningGateway) -> None:
    """20 WebSockets from another origin and 20 requests naming a rebound Host."""
    port = server.gateway.http_port
    for _ in range(20):
        origin: Any = "http://evil.example"
        with ws_connect(server.ws_url + "/evergreen", origin=origin) as ws, contextlib.suppress(Exception):
            ws.recv(timeout=10)
        httpx.get(server.http_url + "/v1/models", headers={"Host": f"evil.example:{port}"})


def bad_input(server: RunningGateway) -> None:
    """JSON 100k deep and 5000-digit integers (OpenAI, GraphPipe config), an overflowing shape, garbage gRPC."""
    deep = "[" * 100_000 + "]" * 100_000
    huge = '{"model": "tiny-llama", "prompt": "hi", "max_tokens": ' + "1" * 5000 + "}"
    for body in (deep, huge):
        httpx.post(server.http_url + "/v1/completions", content=body, timeout=30)
    requests.post(server.http_url + "/graphpipe", data=infer_buffer([np.array(["hi"])], config=deep), timeout=30)
    requests.post(server.http_url + "/graphpipe", data=overflowing_shape_request(), timeout=30)
    with grpc.insecure_channel(server.grpc_target) as channel:
        start = channel.stream_stream("/evergreen.v2.EvergreenService/StartSession", lambda b: b, bytes)
        with contextlib.suppress(grpc.RpcError):
            list(start(iter([b"\xff\xff\xff"]), timeout=30))


def _numbers(count: int) -> str:
    return "[0.5" + ", 0.5" * (count - 1) + "]"


def huge_directions(server: RunningGateway) -> None:
    """A steering direction of 5M numbers: an OpenAI body, an Evergreen Struct config, a GraphPipe config."""
    steering = '[{"direction": ' + _numbers(5_000_000) + ', "layer": 0, "scale": 4}]'
    body = '{"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "steering": ' + steering + "}"
    httpx.post(server.http_url + "/v1/completions", content=body.encode(), timeout=120)
    frame = msg(actions=[generate("p", "r", config={"maxTokens": 2, "steering": "@@"})]).replace('"@@"', steering)
    asyncio.run(_evergreen_until_closed(server, frame))
    config = '{"max_tokens": 2, "steering": ' + steering + "}"
    requests.post(server.http_url + "/graphpipe", data=infer_buffer([np.array(["hi"])], config=config), timeout=120)


def extreme_directions(server: RunningGateway) -> None:
    """Directions of [1e-200], [1.2e154] and [1e200] at the hidden size: steered as unit vectors, never a 500."""
    hidden = server.gateway.service.info().readouts.hidden_size
    for value in (1e-200, 1.2e154, 1e200):
        steering = [{"direction": [value] * hidden, "layer": 0, "scale": 4}]
        body = {"model": model_of(server), "prompt": "hi", "max_tokens": 2, "steering": steering}
        reply = httpx.post(server.http_url + "/v1/completions", json=body, timeout=120)
        if reply.status_code != 200:
            raise RuntimeError(f"{value}: {reply.status_code} {reply.text[:200]}")


# The eight clients of row 10 in a process of their own: reading eight 21 MB answers takes the
# interpreter lock for seconds, and in the gateway's process that is the attacker's cost, not the
# server's (in-process the probe's worst was 0.96-1.25 s). Each may wait long: the memory budget, which
# counts each one's 81 MB of keys and values on SmolLM2, runs them one or two at a time (on a CPU with
# AVX2 only, eight take over 15 minutes: the clients wait up to 30).
_ECHO_CLIENTS = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
import httpx
url, body = sys.argv[1], json.loads(sys.argv[2])
def one(_):
    with httpx.stream("POST", url, json=body, timeout=1800) as reply:
        for _ in reply.iter_bytes():
            pass
        return reply.status_code
with ThreadPoolExecutor(8) as pool:
    print(json.dumps(list(pool.map(one, range(8)))))
"""


def echo_flood(server: RunningGateway) -> None:
    """Eight /v1/completions at once, from another process: echo, top-20 logprobs and readouts on a
    3,516-token prompt."""
    body = {"model": model_of(server), "prompt": [5 + i % 200 for i in range(3516)], "max_tokens": 16, "echo": True}
    body |= {"logprobs": 20, "readouts": True}
    argv = [sys.executable, "-c", _ECHO_CLIENTS, server.http_url + "/v1/completions", json.dumps(body)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=2400, check=False)
    codes = json.loads(done.stdout) if done.returncode == 0 else done.stderr[-500:]
    if codes != [200] * 8:
        raise RuntimeError(f"statuses {codes}")


ATTACKS: dict[str, tuple[int, Attack]] = {
    "1 amplification (2^24-leaf DAG)": (1, amplification),
    "2 quadratic (1034 actions)": (2, quadratic),
    "3 unbounded lists (1M ranges)": (3, million_ranges),
    "4 work before checks (20 MB prompt)": (4, huge_prompt),
    "5 clients that stop reading": (5, non_readers),
    "6 unfinished requests (40 sockets)": (6, unfinished_requests),
    "7 idle sessions (64 sockets)": (7, idle_sessions),
    "8 foreign origins and hosts": (8, foreign_origins),
    "9 bad input (deep JSON, huge ints, ...)": (9, bad_input),
    "10 memory: 8 echoes with top-20 logprobs and readouts": (10, echo_flood),
    "11 a 5M-number direction (OpenAI, Evergreen, GraphPipe)": (11, huge_directions),
    "12 directions of 1e-200, 1.2e154, 1e200": (12, extreme_directions),
}


@contextlib.contextmanager
def gateway(model: str = "tiny") -> Iterator[RunningGateway]:
    if model == "tiny":
        model_dir, pack = long_model()
        served: dict[str, Any] = {"model": str(model_dir), "model_name": MODEL, "concept_pack": str(pack)}
    else:
        served = {}  # the embedded SmolLM2 and its pack
    values = settings(
        **served,
        max_active=3,
        slow_client_timeout_s=SLOW_CLIENT_TIMEOUT_S,
        slow_client_buffer_bytes=64 << 10,
        http_header_timeout_s=2.0,
        http_body_timeout_s=2.0,
    )
    with serve_in_thread(values, ready_timeout=300) as server:
        yield server


def run(names: list[str], model: str = "tiny") -> list[dict[str, Any]]:
    rows = []
    with gateway(model) as server:
        for name in names:
            _, attack = ATTACKS[name]
            watch = UnderAttack(server.http_url, model=model_of(server)).start()
            started = time.perf_counter()
            try:
                watch.wait_for_victims(1, timeout=60)  # the watch is running before the attack starts
                attack(server)
                error = ""
            except Exception as exc:  # a broken attack is reported in its row, the others still run
                error = f"{type(exc).__name__}: {exc}"
            finally:
                watch.stop()
            rows.append({"attack": name, "seconds": time.perf_counter() - started, **watch.report(), "error": error})
            print(_row(rows[-1]), flush=True)
    return rows


HEADER = "| attack | took (s) | /healthz worst (s) | victim worst (s) | victims served | RSS growth (MB) |"


def _row(r: dict[str, Any]) -> str:
    cells = [
        r["attack"],
        f"{r['seconds']:.1f}",
        f"{r['probe_worst_s']:.3f}",
        f"{r['victim_worst_s']:.2f}",
        str(r["victims"]),
        f"{r['rss_growth_mb']:.0f}",
    ]
    line = "| " + " | ".join(cells) + " |"
    return line + (f" error: {r['error']}" if r["error"] else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated class numbers to run (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="the model attacked (tiny)")
    args = parser.parse_args(argv)
    wanted = {int(n) for n in args.only.split(",") if n.strip()}
    names = [name for name, (number, _) in ATTACKS.items() if not wanted or number in wanted]
    print(HEADER)
    print("|---|---|---|---|---|---|")
    rows = run(names, args.model)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
