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

``--processes 1,2`` measures instead how the front-end scales over processes
(``serve --workers``): the null engine served by bench/null_server.py in a process tree of
its own (one process; or the supervisor, the engine host and N front-ends), OpenAI SSE,
Evergreen and Salience (16 gRPC connections, so every front-end gets some) with readouts
off and on every token (8 x 8), at 64 and 256 streams, the streams split over
``--client-processes`` client processes (2) so that one Python client is not the ceiling.
Per cell: tokens streamed per second (wall) and the server tree's CPU per token; then each
N-process cell over the 1-process cell (goal for 2: throughput >= 1.8x, on a machine with
cores to spare for the clients). Every server tree is up for the whole run, and each round
runs every cell on 1 and N processes back to back (the order alternating from round to
round); medians and spread over ``--reps`` rounds, and each round's N-over-1 ratio.
Results: bench/results/overhead_scaling.json.

``--client raw`` (with ``--processes``) drives OpenAI and Evergreen with the cheapest Python
clients there are (bench/clients.py ``openai_raw``, ``evergreen_raw``): bare asyncio sockets,
a connection per generation, the tokens counted in the bytes read (``data: `` events; the
response's fragments) with no parsing, each connection reading at most once per 5 ms tick;
one client process, and each stream runs generations back to back until the cell has
``--cell-tokens`` (65,536). So the clients cost a small part of what the server does per
token and, on a 2-core machine, the server can use the cores. Results:
bench/results/overhead_scaling_raw.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import clients
from bench.common import (
    ROOT,
    CpuMeter,
    Server,
    median,
    model_settings,
    percentile,
    serve,
    settings,
    table,
    write_results,
)
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


# -- scaling: 1 and N front-end processes (--processes) -------------------------------------------

SCALING_PROTOCOLS = ("openai", "evergreen", "salience")
RAW_PROTOCOLS = ("openai", "evergreen")  # --client raw: no Salience (gRPC has no cheap bare-socket client)
SCALING_COLUMNS = (
    "processes",
    "streams",
    "protocol",
    "readouts",
    "tokens_per_s",
    "tokens_per_s_low",
    "tokens_per_s_high",
    "cpu_us_per_token",
    "server_cpu_share",
    "client_cpu_share",
)
RATIO_COLUMNS = (
    "streams",
    "protocol",
    "readouts",
    "processes",
    "throughput_ratio",
    "ratio_low",
    "ratio_high",
    "cpu_per_token_ratio",
)


@contextlib.contextmanager
def null_server(workers: int) -> Iterator[tuple[str, str, Any]]:
    """``bench.null_server`` with ``workers`` front-ends in a process of its own: (HTTP URL, gRPC target, process)."""
    import httpx
    import psutil

    folder = Path(tempfile.mkdtemp(prefix="prismgate-bench-"))
    port_file = folder / "ports.json"
    log = (folder / "server.log").open("w")
    command = [sys.executable, "-m", "bench.null_server", "--workers", str(workers), "--port-file", str(port_file)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the null server did not start: " + (folder / "server.log").read_text())
            time.sleep(0.05)
        ports = json.loads(port_file.read_text())
        http_url, grpc_target = f"http://127.0.0.1:{ports['http_port']}", f"127.0.0.1:{ports['grpc_port']}"
        while httpx.get(http_url + "/readyz", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the null server never became ready")
            time.sleep(0.1)
        yield http_url, grpc_target, psutil.Process(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def tree_cpu_s(process: Any) -> float:
    """CPU seconds (user + system) of a process and all its descendants now alive."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(Exception):  # a child that exited in between
            times = p.cpu_times()
            total += times.user + times.system
    return total


@functools.cache
def _tokenizer() -> Any:
    """The null engine's tokenizer, built once per client process (not inside a timed cell)."""
    from tests.tiny_model import build_tokenizer

    return build_tokenizer()


def scaling_client(proto: str, mode: str, http_url: str, grpc_target: str, kind: str = "python") -> clients.Client:
    """``proto``'s client with readouts ``mode`` (off / every) on the null engine's model; ``kind``
    ``raw``: the bare-socket clients that count tokens in the bytes (OpenAI, Evergreen)."""
    hf = _tokenizer()
    if proto == "salience":
        if kind == "raw":
            raise ValueError("--client raw: OpenAI and Evergreen only")
        every = None if mode == "off" else (lambda n, m: [(n, n + m)])
        return clients.Salience(grpc_target, "null", every, channels=16)
    if proto == "evergreen":
        ws_url = http_url.replace("http://", "ws://")
        make = clients.evergreen_raw if kind == "raw" else clients.evergreen
        return make(ws_url, lambda ids: str(hf.decode(list(ids))), None if mode == "off" else {})
    make_openai = clients.openai_raw if kind == "raw" else clients.openai_sse
    return make_openai(http_url, "null", None if mode == "off" else {"readouts": True})


async def run_streams(
    client: clients.Client, prompt: Sequence[int], max_tokens: int, streams: int, each: int
) -> list[clients.StreamResult]:
    """``streams`` loops at once, each ``each`` generations back to back (the concurrency stays
    ``streams`` until the last loop's last generation)."""

    async def loop() -> list[clients.StreamResult]:
        return [await client(prompt, max_tokens) for _ in range(each)]

    return [r for rs in await asyncio.gather(*(loop() for _ in range(streams))) for r in rs]


ClientJob = tuple[str, str, str, str, str, list[int], int, int, int]


def _client_cell(job: ClientJob) -> tuple[int, float]:
    """One client process's share of a cell: ``streams`` loops of ``each`` generations; (tokens
    received, this process's CPU seconds)."""
    kind, proto, mode, http_url, grpc_target, prompt, max_tokens, streams, each = job

    async def go() -> int:
        client = scaling_client(proto, mode, http_url, grpc_target, kind)
        results = await run_streams(client, prompt, max_tokens, streams, each)
        for closer in (getattr(client, "close", None), getattr(getattr(client, "client", None), "aclose", None)):
            if closer is not None:
                await closer()
        return sum(r.tokens for r in results)

    cpu0 = time.process_time()
    tokens = asyncio.run(go())
    return tokens, time.process_time() - cpu0


def measure_scaling(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Tokens/s and server CPU per token through 1 and N front-end processes, per protocol and readouts.

    Every server tree is up for the whole run (an idle one costs nothing that counts: its
    CPU is not read while another runs). Each round runs every (protocol, readouts, streams)
    cell in an order that rotates from round to round, and each cell on every process count
    back to back, the order of the process counts alternating from round to round; a
    round's ratio is its N-process cell over the 1-process cell beside it.
    """
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tests.tiny_model import build_tokenizer

    prompt = [int(t) for t in build_tokenizer().encode("Tell me a long story about the sea. Once upon a time")]
    protocols = RAW_PROTOCOLS if args.client == "raw" else SCALING_PROTOCOLS
    cells = [(s, p, m) for s in args.concurrency for p in protocols if p in args.protocols for m in ("off", "every")]
    k = args.client_processes
    cores = os.cpu_count() or 1
    measured: dict[tuple[int, int, str, str], list[tuple[int, float, float, float]]] = {}
    with contextlib.ExitStack() as stack, ProcessPoolExecutor(k, mp_context=get_context("spawn")) as pool:
        servers = {n: stack.enter_context(null_server(n)) for n in args.processes}
        for workers, (http_url, grpc_target, _) in servers.items():  # warm up every path, check the counts
            for _, proto, mode in cells[: len(cells) // len(args.concurrency)]:
                job: ClientJob = (args.client, proto, mode, http_url, grpc_target, prompt, 8, 2, 1)
                got = [tokens for tokens, _ in pool.map(_client_cell, [job] * k)]
                if got != [16] * k:
                    raise RuntimeError(f"{workers} process(es), {proto} {mode}: {got} tokens counted, not 16 each")
        for rep in range(args.reps):
            shift = rep % len(cells)
            order = args.processes if rep % 2 == 0 else args.processes[::-1]
            for streams, proto, mode in cells[shift:] + cells[:shift]:
                each = max(1, round(args.cell_tokens / (streams * args.max_tokens))) if args.cell_tokens else 1
                for workers in order:
                    http_url, grpc_target, process = servers[workers]
                    job = (args.client, proto, mode, http_url, grpc_target, prompt, args.max_tokens, streams // k, each)
                    cpu0, t0 = tree_cpu_s(process), time.perf_counter()
                    shares = list(pool.map(_client_cell, [job] * k))
                    wall, cpu = time.perf_counter() - t0, tree_cpu_s(process) - cpu0
                    tokens, client_cpu = sum(t for t, _ in shares), sum(c for _, c in shares)
                    measured.setdefault((workers, streams, proto, mode), []).append((tokens, wall, cpu, client_cpu))
                line = "  ".join(
                    f"{n}p {r[-1][0] / r[-1][1]:.0f} tok/s"
                    for n in args.processes
                    for r in [measured[(n, streams, proto, mode)]]
                )
                print(f"round {rep + 1}: {streams} streams {proto} {mode}: {line}", flush=True)
    rows = []
    for (workers, streams, proto, mode), runs in measured.items():
        rates = [t / w for t, w, _, _ in runs]
        rows.append(
            {
                "processes": workers,
                "streams": streams,
                "protocol": proto,
                "readouts": mode,
                "rounds": len(runs),
                "tokens_per_s": median(rates),
                "tokens_per_s_low": min(rates),
                "tokens_per_s_high": max(rates),
                "cpu_us_per_token": median([c / t * 1e6 for t, _, c, _ in runs]),
                "server_cpu_share": median([c / w / cores for _, w, c, _ in runs]),
                "client_cpu_share": median([cc / w / cores for _, w, _, cc in runs]),
                "runs": [{"tokens": t, "wall_s": w, "server_cpu_s": c, "client_cpu_s": cc} for t, w, c, cc in runs],
            }
        )
    rows.sort(key=lambda r: (r["streams"], r["protocol"], r["readouts"] != "off", r["processes"]))
    return rows, scaling_ratios(measured)


def scaling_ratios(
    measured: dict[tuple[int, int, str, str], list[tuple[int, float, float, float]]],
) -> list[dict[str, Any]]:
    """Each N-process cell over the 1-process cell of the same round: throughput and CPU per token."""
    out = []
    for (workers, streams, proto, mode), runs in measured.items():
        base = measured.get((1, streams, proto, mode))
        if workers == 1 or base is None:
            continue
        pairs = list(zip(runs, base, strict=False))
        ratios = [(t / w) / (bt / bw) for (t, w, _, _), (bt, bw, _, _) in pairs]
        cpu_ratios = [(c / t) / (bc / bt) for (t, _, c, _), (bt, _, bc, _) in pairs]
        out.append(
            {
                "streams": streams,
                "protocol": proto,
                "readouts": mode,
                "processes": workers,
                "throughput_ratio": median(ratios),
                "ratio_low": min(ratios),
                "ratio_high": max(ratios),
                "cpu_per_token_ratio": median(cpu_ratios),
                "round_ratios": ratios,
            }
        )
    out.sort(key=lambda r: (r["streams"], r["protocol"], r["readouts"] != "off", r["processes"]))
    return out


def main_scaling(args: argparse.Namespace) -> int:
    load = [os.getloadavg()[0]]
    rows, ratios = measure_scaling(args)
    load.append(os.getloadavg()[0])
    print(table(rows, SCALING_COLUMNS))
    print("## N processes over 1, medians of the rounds' ratios (goal for 2: throughput_ratio >= 1.8)")
    print(table(ratios, RATIO_COLUMNS))
    print(f"load average (1 minute): {load[0]:.2f} at the start, {load[1]:.2f} at the end", flush=True)
    path = write_results(
        args.results or ("overhead_scaling_raw" if args.client == "raw" else "overhead_scaling"),
        {
            "command": " ".join(sys.argv),
            "client": args.client,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "cell_tokens": args.cell_tokens,
            "client_processes": args.client_processes,
            "load_average": load,
            "rows": rows,
            "ratios": ratios,
        },
    )
    print(f"results: {path}")
    return 0


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
    parser.add_argument(
        "--processes",
        default=None,
        help="measure scaling instead: front-end process counts (e.g. 1,2) over the null engine, "
        "OpenAI/Evergreen/Salience, readouts off and every; concurrency defaults to 64,256",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="--processes: client processes sharing the streams (2; --client raw: 1)",
    )
    parser.add_argument(
        "--client",
        choices=("python", "raw"),
        default="python",
        help="--processes: python (the protocols' own client libraries, parsing every message) or raw "
        "(bare sockets counting tokens in the bytes; OpenAI and Evergreen)",
    )
    parser.add_argument(
        "--cell-tokens",
        type=int,
        default=None,
        help="--processes: tokens per cell, each stream running generations back to back "
        "(0: one generation per stream; --client raw: 65536)",
    )
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.reps = args.reps or (1 if args.quick else 3)
    args.streams_per_cell = args.streams_per_cell or (8 if args.quick else 32)
    if args.processes is not None and args.concurrency == "1,8,32":
        args.concurrency = "64,256"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.protocols = args.protocols.split(",")
    if args.processes is not None:
        raw = args.client == "raw"
        args.client_processes = args.client_processes or (1 if raw else 2)
        args.cell_tokens = (65536 if raw else 0) if args.cell_tokens is None else args.cell_tokens
        args.processes = [int(n) for n in args.processes.split(",")]
        if 1 not in args.processes:
            parser.error("--processes must include 1 (the ratios are over one process)")
        return main_scaling(args)
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
