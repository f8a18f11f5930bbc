"""Benchmark 1: gateway overhead per protocol, as ratios to SessionService driven in-process.

    .venv/bin/python -m bench.overhead [--quick] [--engines null,tiny] [--concurrency 1,8,32]

One gateway per engine (a real ``prismgate.server.Gateway`` on free loopback ports, in a
background thread); the same prompt and greedy decoding through:

* ``inproc``: ``SessionService.run`` on the gateway's own loop (no wire, no codec);
* ``salience``: gRPC server stream (grpc.aio client);
* ``evergreen``: WebSocket, JSON frames, one connection per generation;
* ``graphpipe``: one flatbuffer POST (not streamed: TTFT is the whole response);
* ``openai``: ``/v1/completions`` with Server-Sent Events.

At each concurrency (1, 8, 32 streams at once) the protocols run in rotating order,
``--reps`` times, so drift in the machine's speed spreads over all of them. Two engines:
``null`` (bench/null_engine.py: tokens at no cost, so every microsecond is the gateway's:
its ceiling in tokens/s per core of gateway CPU) and ``tiny`` (the tests' tiny random Llama
on the transformers engine, one worker thread).

Results: a table on stdout and bench/results/overhead.json.

``--readouts off,every,base64`` measures instead what readouts cost the front-end, on the
null engine with an 8 x 8 readout (the default pack's 64 values, random full-length
float32s) on every generated token: Salience (protobuf floats), Evergreen and OpenAI SSE
(JSON numbers, or base64 of float32 with ``base64``), readouts off beside them. Every
(protocol, readouts) cell runs once per round, in an order that rotates from round to
round; a round's ratio is its CPU per token over the same round's ``off`` of that
protocol; the medians and the spread (lowest, highest) over ``--reps`` rounds go to
bench/results/overhead_readouts.json (``--results NAME`` to write another name, e.g. a
baseline run on older code with ``--readouts off,every``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import clients
from bench.common import CpuMeter, Server, median, model_settings, percentile, serve, settings, table, write_results
from bench.null_engine import NullEngine

PROTOCOLS = ("inproc", "salience", "evergreen", "graphpipe", "openai")
READOUT_MODES = ("off", "every", "base64")
READOUT_SHAPE = (8, 8)  # the default pack's layers x concepts


async def run_cell(
    client: clients.Client, prompt: Sequence[int], max_tokens: int, streams: int, rounds: int
) -> tuple[list[clients.StreamResult], float]:
    """``rounds`` times ``streams`` generations at once; wall time measured on the loop that runs them."""
    results: list[clients.StreamResult] = []
    t0 = time.perf_counter()
    for _ in range(rounds):
        results += await asyncio.gather(*(client(prompt, max_tokens) for _ in range(streams)))
    return results, time.perf_counter() - t0


async def find_prompt(server: Server, max_tokens: int) -> list[int]:
    """A prompt whose greedy answer runs ``max_tokens`` without EOS (some protocols cannot ignore EOS)."""
    tokenizer = server.service.info().tokenizer
    inproc = clients.inproc(server.service)
    for i in range(60):
        prompt = tokenizer.encode(f"Tell me a long story about the sea, number {i}. Once upon a time")
        result = await inproc(prompt, max_tokens)
        if result.tokens == max_tokens:
            return prompt
    raise RuntimeError(f"no prompt found that decodes {max_tokens} tokens without EOS")


async def measure_engine(name: str, server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    info = server.service.info()
    model = info.model_id
    max_tokens = args.max_tokens
    prompt = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(find_prompt(server, max_tokens), server.loop))
    assert info.tokenizer.encode(info.tokenizer.decode(prompt)) == prompt, "the prompt must survive text round trips"

    salience = clients.Salience(server.grpc_target, model)
    by_name: dict[str, clients.Client] = {
        "inproc": clients.inproc(server.service),
        "salience": salience,
        "evergreen": clients.evergreen(server.ws_url, info.tokenizer.decode),
        "graphpipe": clients.graphpipe(server.http_url),
        "openai": clients.openai_sse(server.http_url, model),
    }
    protocols = [p for p in PROTOCOLS if p in args.protocols]

    async def cell(proto: str, streams: int, rounds: int) -> tuple[list[clients.StreamResult], float, CpuMeter]:
        client = by_name[proto]
        with CpuMeter() as cpu:
            if proto == "inproc":  # on the server's loop: the consumer is the core itself
                future = asyncio.run_coroutine_threadsafe(
                    run_cell(client, prompt, max_tokens, streams, rounds), server.loop
                )
                results, wall = await asyncio.wrap_future(future)
            else:
                results, wall = await run_cell(client, prompt, max_tokens, streams, rounds)
        return results, wall, cpu

    for proto in protocols:  # warm up every path (imports, connections, first-call costs)
        await cell(proto, 2, 1)

    rows: list[dict[str, Any]] = []
    for streams in args.concurrency:
        rounds = max(1, args.streams_per_cell // streams)
        collected: dict[str, list[clients.StreamResult]] = {p: [] for p in protocols}
        cpu_s: dict[str, float] = dict.fromkeys(protocols, 0.0)
        wall_s: dict[str, float] = dict.fromkeys(protocols, 0.0)
        for rep in range(args.reps):
            order = protocols[rep % len(protocols) :] + protocols[: rep % len(protocols)]
            for proto in order:
                results, wall, cpu = await cell(proto, streams, rounds)
                collected[proto] += results
                cpu_s[proto] += cpu.server_s
                wall_s[proto] += wall
        base = collected.get("inproc")
        base_ttft = median([r.ttft_s for r in base]) if base else float("nan")
        base_tpt = median([r.per_token_s for r in base]) if base else float("nan")
        base_rate = sum(r.tokens for r in base) / wall_s["inproc"] if base else float("nan")
        for proto in protocols:
            res = collected[proto]
            tokens = sum(r.tokens for r in res)
            ttft = median([r.ttft_s for r in res])
            tpt = median([r.per_token_s for r in res])
            rate = tokens / wall_s[proto]
            rows.append(
                {
                    "engine": name,
                    "streams": streams,
                    "protocol": proto,
                    "generations": len(res),
                    "tokens_each": sorted({r.tokens for r in res}),
                    "ttft_ms": ttft * 1e3,
                    "ttft_p90_ms": percentile([r.ttft_s for r in res], 0.9) * 1e3,
                    "per_token_ms": tpt * 1e3,
                    "tokens_per_s": rate,
                    "gateway_cpu_s": cpu_s[proto],
                    "tokens_per_cpu_s": tokens / cpu_s[proto],
                    "ttft_ratio": ttft / base_ttft,
                    "per_token_ratio": tpt / base_tpt if proto != "graphpipe" else float("nan"),
                    "throughput_ratio": rate / base_rate,
                    "request_bytes": median([r.sent_bytes for r in res]),
                    "response_bytes": median([r.received_bytes for r in res]),
                }
            )
        print(table([r for r in rows if r["streams"] == streams], COLUMNS), flush=True)
    await salience.close()
    for client in by_name.values():
        http = getattr(client, "client", None)
        if http is not None:
            await http.aclose()
    return rows


def readout_client(server: Server, proto: str, mode: str) -> clients.Client | None:
    """``proto``'s client asking for readouts ``mode`` on every generated token; None where it has no such form."""
    info = server.service.info()
    if proto == "salience":
        if mode == "base64":  # protobuf floats are binary already
            return None
        every = None if mode == "off" else (lambda n, m: [(n, n + m)])
        return clients.Salience(server.grpc_target, info.model_id, every)
    if proto == "evergreen":
        config = {"off": None, "every": {}, "base64": {"readoutEncodingFormat": "base64"}}[mode]
        return clients.evergreen(server.ws_url, info.tokenizer.decode, config)
    if proto == "openai":
        extra = {"off": None, "every": {"readouts": True}, "base64": {"readouts": {"encoding_format": "base64"}}}[mode]
        return clients.openai_sse(server.http_url, info.model_id, extra)
    raise ValueError(f"no readouts client for {proto!r}")


async def measure_readouts(server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    """CPU per streamed token, readouts off / every token / every token as base64, per protocol."""
    max_tokens = args.max_tokens
    prompt = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(find_prompt(server, max_tokens), server.loop))
    protocols = [p for p in ("salience", "evergreen", "openai") if p in args.protocols]
    cells: dict[tuple[str, str], clients.Client] = {}
    for proto in protocols:
        for mode in args.readouts:
            client = readout_client(server, proto, mode)
            if client is not None:
                cells[(proto, mode)] = client
    order = list(cells)
    for key in order:  # warm up every path
        await run_cell(cells[key], prompt, max_tokens, 2, 1)
    rows: list[dict[str, Any]] = []
    for streams in args.concurrency:
        rounds = max(1, args.streams_per_cell // streams)
        per_token: dict[tuple[str, str], list[float]] = {key: [] for key in order}
        rates: dict[tuple[str, str], list[float]] = {key: [] for key in order}
        sizes: dict[tuple[str, str], list[float]] = {key: [] for key in order}
        for rep in range(args.reps):
            shift = rep % len(order)
            for key in order[shift:] + order[:shift]:
                with CpuMeter() as cpu:
                    results, wall = await run_cell(cells[key], prompt, max_tokens, streams, rounds)
                tokens = sum(r.tokens for r in results)
                per_token[key].append(cpu.server_s / tokens * 1e6)
                rates[key].append(tokens / wall)
                sizes[key].append(median([r.received_bytes / max(1, r.tokens) for r in results]))
        for proto, mode in order:
            ratios = [a / b for a, b in zip(per_token[(proto, mode)], per_token[(proto, "off")], strict=True)]
            rows.append(
                {
                    "streams": streams,
                    "protocol": proto,
                    "readouts": mode,
                    "cpu_us_per_token": median(per_token[(proto, mode)]),
                    "cpu_us_low": min(per_token[(proto, mode)]),
                    "cpu_us_high": max(per_token[(proto, mode)]),
                    "tokens_per_cpu_s": 1e6 / median(per_token[(proto, mode)]),
                    "tokens_per_s": median(rates[(proto, mode)]),
                    "bytes_per_token": median(sizes[(proto, mode)]),
                    "ratio_to_off": median(ratios),
                    "ratio_low": min(ratios),
                    "ratio_high": max(ratios),
                }
            )
        print(table([r for r in rows if r["streams"] == streams], READOUT_COLUMNS), flush=True)
    for client in cells.values():
        close = getattr(client, "close", None)
        if close is not None:
            await close()
        http = getattr(client, "client", None)
        if http is not None:
            await http.aclose()
    return rows


READOUT_COLUMNS = (
    "streams",
    "protocol",
    "readouts",
    "cpu_us_per_token",
    "cpu_us_low",
    "cpu_us_high",
    "tokens_per_cpu_s",
    "bytes_per_token",
    "ratio_to_off",
    "ratio_low",
    "ratio_high",
)


def main_readouts(args: argparse.Namespace) -> int:
    engine = NullEngine(readouts=READOUT_SHAPE, readout_values="random")
    load = [os.getloadavg()[0]]
    # 256 streams are 256 connections from one address: past the default cap of 128
    with serve(settings(model_name="null", max_connections_per_client=0), engine) as server:
        rows = asyncio.run(measure_readouts(server, args))
    load.append(os.getloadavg()[0])
    path = write_results(
        args.results or "overhead_readouts",
        {
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "streams_per_cell": args.streams_per_cell,
            "readout_shape": list(READOUT_SHAPE),
            "load_average": load,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    return 0


COLUMNS = (
    "engine",
    "streams",
    "protocol",
    "ttft_ms",
    "per_token_ms",
    "tokens_per_s",
    "tokens_per_cpu_s",
    "ttft_ratio",
    "per_token_ratio",
    "throughput_ratio",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repetitions (about a minute)")
    parser.add_argument("--engines", default="null,tiny", help="comma-separated: null, tiny")
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per generation (64; quick 32)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions per cell (3; quick 1)")
    parser.add_argument("--streams-per-cell", type=int, default=None, help="generations per cell per rep (32; quick 8)")
    parser.add_argument("--readouts", default=None, help="measure readouts instead: modes of off, every, base64")
    parser.add_argument("--results", default=None, help="results file name for --readouts (overhead_readouts)")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.reps = args.reps or (1 if args.quick else 3)
    args.streams_per_cell = args.streams_per_cell or (8 if args.quick else 32)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.protocols = args.protocols.split(",")
    if args.readouts is not None:
        args.readouts = args.readouts.split(",")
        if "off" not in args.readouts or not set(args.readouts) <= set(READOUT_MODES):
            parser.error(f"--readouts: off and any of {READOUT_MODES[1:]}")
        return main_readouts(args)

    rows: list[dict[str, Any]] = []
    for name in args.engines.split(","):
        if name == "null":
            engine: Any = NullEngine()
            config = settings(model_name="null")
        elif name == "tiny":
            engine = None
            config = model_settings(name)
        else:
            parser.error(f"unknown engine {name!r}")
        print(f"## engine {name}", flush=True)
        with serve(config, engine) as server:
            rows += asyncio.run(measure_engine(name, server, args))
    path = write_results(
        "overhead",
        {
            "quick": args.quick,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "streams_per_cell": args.streams_per_cell,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
