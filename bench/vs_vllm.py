"""Benchmark 2: ``prismgate serve --engine vllm`` against ``vllm serve`` as it ships, side by side.

    .venv-vllm/bin/python bench/vs_vllm.py [--quick] [--model PATH] [--concurrency 1,4,8] [--frontend-only]
    .venv-vllm/bin/python bench/vs_vllm.py --processes 2 [--concurrency 64,256]
    .venv-vllm/bin/python bench/vs_vllm.py --vllm-bench [--reps 9] [--num-prompts N] [--input-len 128]

Runs only in ``.venv-vllm`` (``make vllm-venv``). Three servers run at once, each in its own
process, on the same model and dtype, each otherwise with its own defaults:

* ``vllm serve``: vLLM's OpenAI server with vLLM's defaults (torch.compile; on GPUs, CUDA
  graphs): the peer a user would run, and the baseline every ratio is taken against;
* ``vllm serve --enforce-eager``: the same in eager mode, reported beside it;
* ``prismgate serve --engine vllm`` with the model's concept pack and SAE (``--sae``; for the
  default model its shipped one), driven four ways: OpenAI SSE with readouts off, OpenAI SSE
  with readouts on every generated token (``"readouts": true``), OpenAI SSE with SAE features
  on every generated token (``"features": true``, where an SAE is loaded), and Salience gRPC
  with readouts at 4 positions of the answer.

The same token prompt, streamed, greedy, the same answer length everywhere; rounds
alternate between the targets so drift in the machine's speed hits all of them (9 rounds
per target and concurrency unless ``--reps`` says otherwise). Equal work is checked, not
assumed: every OpenAI request sends ``"ignore_eos": true``, every answer's length is read
from the server's own count (the stream's ``usage``; Salience's ``GenerateDone``, which cannot
ask to ignore EOS), and a round in which any answer is not ``--max-tokens`` long (or has no
count) fails: it is printed, kept out of every figure and ratio, listed in the results, and
the run exits 1. Decode rates are computed from those counts. Per target
and concurrency: TTFT and decode tokens/s per stream (medians) and their ratios to ``vllm
serve``, and the front-end process's CPU seconds per streamed token: the API-server process
only (vLLM's engine core and workers are its children and are not counted), read from
``/proc`` (each thread's nanosecond ``schedstat``) around each of the target's own rounds.
Each figure is the median over rounds, and each ratio the median of every round's ratio to
``vllm serve``'s round of the same rep (a round's TTFT and decode rate: the medians of its
streams): on a shared machine the load drifts between reps, and a ratio of neighbours
carries less of it than a ratio of totals.

``--frontend-only`` runs just ``vllm serve`` and prismgate's OpenAI SSE targets (readouts off,
readouts every token, and features every token where an SAE is loaded), for the CPU comparison
(more rounds in the same time: ``--reps 8 --max-tokens 128``, say).

``--processes 2`` compares the two answers to a front-end that one core cannot keep up
with, at 64 and 256 streams unless ``--concurrency`` says otherwise: ``vllm serve`` (the
base), ``vllm serve --api-server-count 2`` (two API-server processes over one engine core),
``prismgate serve --engine vllm`` and ``prismgate serve --engine vllm --workers 2`` (two
front-ends over one engine host), each prismgate with readouts off and on every token, all
over OpenAI SSE. Front-end CPU is then that of every process of the server's tree but
vLLM's engine core and its workers (titled ``VLLM::EngineCore``, ``VLLM::Worker``,
``VLLM::DPCoordinator``): vLLM's API servers and their launcher; prismgate's supervisor,
front-ends and engine host (which runs ``AsyncLLM``'s output processing, as vLLM's API
server does).

``--vllm-bench`` measures both servers with vLLM's own benchmark client instead
(``vllm bench serve``, :mod:`bench.vllm_bench`): ``vllm serve`` and prismgate, the random
dataset (``--input-len`` prompt tokens, ``--max-tokens`` answer tokens, ``--num-prompts``
requests per run, 4 per stream unless given), ``--ignore-eos``, greedy, ``--max-concurrency``
each of ``--concurrency``; one run per server per round, the order alternating, each round's
prompts its own (the same for both servers). The client prints its report after every run; a
run with failed requests or answers of another length fails its round. At the end, per
concurrency, the two servers side by side: output tokens/s, median TTFT and median TPOT
(each the median over rounds, with the lowest and highest) and prismgate's ratio to ``vllm
serve`` (the median of per-round ratios, with their spread).

On CPU, vLLM's worker refuses to start unless 90% of the machine's memory is free or a
KV-cache size is given; both servers get the same explicit KV cache (``--kv-cache-gb``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# What every server process here gets: one OpenMP thread (CPU step times swing wildly
# without it on a shared box), no CPU pinning, nothing from the network.
SERVER_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

from bench import clients  # noqa: E402
from bench.common import ROOT, median, table, write_results  # noqa: E402
from bench.vllm_bench import bench_argv, problems, run_bench  # noqa: E402

# ``vllm serve`` with several API servers, started through the serve subcommand (the CLI's main
# looks up the "vllm" distribution's version, which vllm-cpu does not have)
SERVE_SUBCOMMAND = """
import sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser
cli_env_setup()
parser = FlexibleArgumentParser()
command = ServeSubcommand()
command.subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args(sys.argv[1:])
command.validate(args)
command.cmd(args)
"""
MODEL_NAME = "smollm2"
PRISMGATE_TARGETS = ("vllm", "transformers", "transformers-eager")  # --vllm-bench --targets
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
BASE = "vllm serve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    pid: int
    http_url: str
    grpc_target: str | None = None
    features: bool = False  # an SAE is loaded: "features" can be asked


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    """Until ``url`` answers 200 (vLLM's ``/health``; prismgate's ``/readyz``, 200 once the model is loaded)."""
    import httpx

    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not become healthy; see {log}")
        time.sleep(1)


@contextlib.contextmanager
def process(command: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A server in its own process group; stopped (SIGTERM, then SIGKILL) on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def vllm_serve(model: Path, args: argparse.Namespace, *, eager: bool, api_servers: int = 1) -> Iterator[Server]:
    """``vllm serve`` with its own defaults, but for the dtype, context and KV cache both servers share;
    ``api_servers`` > 1: ``--api-server-count``."""
    port = free_port()
    # The CLI looks up the distribution "vllm", which vllm-cpu is not named, so the same
    # server starts through its module entry point (several API servers: the serve
    # subcommand itself, without the CLI's version lookup).
    # Its stats logging stays on, as it ships (prismgate keeps its own metrics per token too).
    entry = ["-m", "vllm.entrypoints.openai.api_server"] if api_servers == 1 else ["-c", SERVE_SUBCOMMAND, "serve"]
    command = [
        sys.executable, *entry, "--model", str(model),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--max-model-len", str(args.max_len),
        "--kv-cache-memory-bytes", str(int(args.kv_cache_gb * (1 << 30))),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
    ]  # fmt: skip
    if eager:
        command.append("--enforce-eager")
    if api_servers > 1:
        command += ["--api-server-count", str(api_servers)]
    name = (
        BASE + (" --enforce-eager" if eager else "") + (f" --api-server-count {api_servers}" if api_servers > 1 else "")
    )
    stem = "vllm-serve" + ("-eager" if eager else "") + (f"-api{api_servers}" if api_servers > 1 else "")
    log = ROOT / "build" / "bench" / f"{args.results}-{stem}.log"  # git-ignored; one set per results name
    env = {**os.environ, **SERVER_ENV}
    with process(command, log, env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url + "/health", log)
        yield Server(name, proc.pid, url)


@contextlib.contextmanager
def prismgate_serve(
    model: Path, pack: Path | None, args: argparse.Namespace, workers: int = 1, target: str = "vllm"
) -> Iterator[Server]:
    """``prismgate serve --engine vllm`` with its defaults (vLLM's compilation), the model's concept pack;
    ``workers`` > 1: that many front-end processes (``--workers``). ``target`` (:data:`PRISMGATE_TARGETS`):
    "transformers" serves the embedded engine with its defaults instead, "transformers-eager" the same
    with ``--no-packed-weights``."""
    engine = ["--engine", "vllm"] if target == "vllm" else ["--engine", "transformers"]
    if target == "vllm":
        engine += [
            "--vllm-kv-cache-gb",
            str(args.kv_cache_gb),
            "--gpu-memory-utilization",
            str(args.gpu_memory_utilization),
        ]
    elif target == "transformers-eager":
        engine.append("--no-packed-weights")
    with tempfile.TemporaryDirectory(prefix="prismgate-bench-") as tmp:
        port_file = Path(tmp) / "ports.json"
        command = [
            sys.executable, "-m", "prismgate", "serve", *engine, "--model", str(model),
            "--model-name", MODEL_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_len),
            "--http-port", "0", "--grpc-port", "0",
            "--port-file", str(port_file), "--log-level", "warning", "--max-active", "256",
            # every stream comes from this one address, and vllm serve caps nothing per address: the
            # default cap (128 connections per client) refused the 256-stream cell of the first run
            "--max-connections-per-client", "0",
        ]  # fmt: skip
        if pack is not None:
            command += ["--concept-pack", str(pack)]
        if args.sae:
            command += ["--sae", args.sae]
        if workers > 1:
            command += ["--workers", str(workers)]
        stem = ("prismgate-serve" if workers == 1 else f"prismgate-serve-w{workers}") + (
            "" if target == "vllm" else f"-{target}"
        )
        log = ROOT / "build" / "bench" / f"{args.results}-{stem}.log"
        env = {**os.environ, **SERVER_ENV}
        with process(command, log, env) as proc:
            deadline = time.monotonic() + 900
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prismgate serve did not start; see {log}")
                time.sleep(1)
            ports = json.loads(port_file.read_text())
            url = f"http://127.0.0.1:{ports['http_port']}"
            wait_healthy(proc, url + "/readyz", log)
            name = ("prismgate" if workers == 1 else f"prismgate --workers {workers}") + (
                "" if target == "vllm" else f" ({target})"
            )
            yield Server(name, proc.pid, url, f"127.0.0.1:{ports['grpc_port']}", features=bool(args.sae))


def cpu_seconds(pid: int) -> float:
    """CPU seconds of this one process, every thread (its children, vLLM's engine core and workers, excluded).

    Read from each thread's ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds) where there is
    one; ``/proc/<pid>/stat`` (what psutil reads) counts in 10 ms ticks, too coarse for a
    round of a few hundred tokens at a fraction of a millisecond each.
    """
    total = 0
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),  # a thread that just ended
                open(f"{task.path}/schedstat") as f,
            ):
                total += int(f.read().split()[0])
        return total / 1e9
    except (FileNotFoundError, PermissionError):  # no /proc (or no schedstat): ticks, from psutil
        import psutil

        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)


ENGINE_TITLES = ("EngineCore", "VLLM::Worker", "DPCoordinator")  # vLLM's engine-side process titles


def frontend_pids(pid: int) -> list[int]:
    """The server's front-end processes: ``pid`` and its descendants, but for vLLM's engine-side
    processes and everything under them."""
    import psutil

    out: list[int] = []
    stack = [psutil.Process(pid)]
    while stack:
        proc = stack.pop()
        with contextlib.suppress(psutil.Error):
            if any(title in " ".join(proc.cmdline()) for title in ENGINE_TITLES):
                continue
            out.append(proc.pid)
            stack += proc.children()
    return out


def frontend_cpu_seconds(pid: int) -> float:
    """CPU seconds of every front-end process of the server ``pid`` (:func:`frontend_pids`)."""
    total = 0.0
    for p in frontend_pids(pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            total += cpu_seconds(p)
    return total


@dataclass
class Target:
    name: str
    pid: int
    client: clients.Client


def few_positions(n_prompt: int, max_tokens: int) -> list[tuple[int, int]]:
    """4 single positions spread over the answer."""
    return [(n_prompt + i * max_tokens // 4, n_prompt + i * max_tokens // 4 + 1) for i in range(4)]


def sse(server: Server, **extra: Any) -> clients.Client:
    """OpenAI SSE to ``server``, every request with ``ignore_eos`` (answers as long as asked) and ``extra``."""
    return clients.openai_sse(server.http_url, MODEL_NAME, extra={"ignore_eos": True, **extra})


def targets(vllm: Server, eager: Server | None, gateway: Server) -> list[Target]:
    """What is measured; without ``eager`` (``--frontend-only``) only the OpenAI SSE targets."""
    out = [Target(BASE, vllm.pid, sse(vllm))]
    if eager is not None:
        out.append(Target(eager.name, eager.pid, sse(eager)))
    out += [
        Target("prismgate, readouts off (OpenAI SSE)", gateway.pid, sse(gateway)),
        Target("prismgate, readouts every token (OpenAI SSE)", gateway.pid, sse(gateway, readouts=True)),
    ]
    if gateway.features:
        out.append(Target("prismgate, features every token (OpenAI SSE)", gateway.pid, sse(gateway, features=True)))
    if eager is not None:
        out.append(
            Target(
                "prismgate, readouts at 4 positions (Salience gRPC)",
                gateway.pid,
                clients.Salience(gateway.grpc_target or "", MODEL_NAME, readout_ranges=few_positions),
            )
        )
    return out


def rate(r: clients.StreamResult) -> float | None:
    if r.tokens > 1 and r.total_s > r.ttft_s:
        return (r.tokens - 1) / (r.total_s - r.ttft_s)
    return None


def scaling_targets(vllm: Server, vllm_api: Server, gateway: Server, gateway_workers: Server) -> list[Target]:
    """``--processes``: each server over OpenAI SSE; prismgate's with readouts off and on every token."""
    out = [Target(s.name, s.pid, sse(s)) for s in (vllm, vllm_api)]
    for server in (gateway, gateway_workers):
        out += [
            Target(f"{server.name}, readouts off", server.pid, sse(server)),
            Target(f"{server.name}, readouts every token", server.pid, sse(server, readouts=True)),
        ]
    return out


def wrong_lengths(results: list[clients.StreamResult], max_tokens: int) -> str | None:
    """Why a round did not do the work it asked for (None: every answer ``max_tokens`` long by the server's count)."""
    counts = [r.usage_tokens for r in results]
    if all(n == max_tokens for n in counts):
        return None
    return f"answers of {counts} tokens (server's count; None: no count sent) where {max_tokens} were asked"


async def measure(
    servers: tuple[Any, ...], prompt: list[int], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every target's rounds at every concurrency: the summary rows, and the rounds that failed."""
    # on this loop: gRPC's aio channels belong to the loop that made them
    ts = scaling_targets(*servers) if args.processes > 1 else targets(*servers)
    cpu_of = frontend_cpu_seconds if args.processes > 1 else cpu_seconds
    for t in ts:  # warm-up
        await t.client(prompt, 4)
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []  # the rounds that did not do the work they asked for
    for streams in args.concurrency:
        results: dict[str, list[clients.StreamResult]] = {t.name: [] for t in ts}
        cpu: dict[str, list[float]] = {t.name: [] for t in ts}  # per round: front-end CPU ms per token
        rounds: dict[str, list[tuple[float, float]]] = {t.name: [] for t in ts}  # per round: (TTFT, decode rate)
        for rep in range(args.reps):
            for t in ts[rep % len(ts) :] + ts[: rep % len(ts)]:
                before = cpu_of(t.pid)
                got = await asyncio.gather(*(t.client(prompt, args.max_tokens) for _ in range(streams)))
                spent = cpu_of(t.pid) - before
                wrong = wrong_lengths(got, args.max_tokens)
                if wrong is not None:  # unequal work: the round counts for nothing (NaN: no ratio)
                    failed.append({"round": rep + 1, "streams": streams, "server": t.name, "why": wrong})
                    print(f"round {rep + 1}/{args.reps} {streams:>3} streams  {t.name}: FAILED, {wrong}", flush=True)
                    cpu[t.name].append(float("nan"))
                    rounds[t.name].append((float("nan"), float("nan")))
                    continue
                results[t.name] += got
                cpu[t.name].append(spent / max(sum(r.tokens for r in got), 1) * 1e3)
                rates = [x for r in got if (x := rate(r)) is not None]
                rounds[t.name].append((median([r.ttft_s for r in got]), median(rates) if rates else float("nan")))
                ttft, decode = rounds[t.name][-1]
                print(  # each round as it ends: a run stopped early keeps what it measured
                    f"round {rep + 1}/{args.reps} {streams:>3} streams  {t.name:<52} TTFT {ttft * 1e3:7.1f} ms  "
                    f"decode {decode:7.2f} tok/s  front-end CPU {cpu[t.name][-1]:.3f} ms/token",
                    flush=True,
                )
        block = [summarize(t.name, streams, results[t.name], cpu[t.name]) for t in ts if results[t.name]]
        if not block or block[0]["server"] != BASE:
            continue  # every round of the base failed: no ratio to give
        for row in block:
            # Every ratio is the median of per-round ratios against the base's round of the same
            # rep: rounds of one rep run back to back, so the machine's drift between reps cancels.
            mine, theirs = rounds[row["server"]], rounds[BASE]
            for key, a, b in (
                ("ttft_ratio", [x[0] for x in mine], [x[0] for x in theirs]),
                ("decode_rate_ratio", [x[1] for x in mine], [x[1] for x in theirs]),
                ("frontend_cpu_ratio", cpu[row["server"]], cpu[BASE]),
            ):
                row[key], row[f"{key}_range"] = paired(a, b), spread(a, b)
        print(table(block, list(block[0])), flush=True)
        rows += block
    for t in ts:
        close = getattr(t.client, "close", None) or getattr(getattr(t.client, "client", None), "aclose", None)
        if close is not None:
            await close()
    return rows, failed


def round_ratios(mine: list[float], base: list[float]) -> list[float]:
    """``mine[i] / base[i]`` for each round (rounds without a value skipped)."""
    return [a / b for a, b in zip(mine, base, strict=True) if b and a == a and b == b]


def paired(mine: list[float], base: list[float]) -> float:
    """The median of round-by-round ratios ``mine[i] / base[i]``."""
    ratios = round_ratios(mine, base)
    return median(ratios) if ratios else float("nan")


def spread(mine: list[float], base: list[float]) -> list[float]:
    """The lowest and highest of the round-by-round ratios (the noise around :func:`paired`'s median)."""
    ratios = round_ratios(mine, base)
    return [min(ratios), max(ratios)] if ratios else []


def summarize(name: str, streams: int, results: list[clients.StreamResult], cpu_ms: list[float]) -> dict[str, Any]:
    return {
        "server": name,
        "streams": streams,
        "generations": len(results),
        "tokens_each": median([r.tokens for r in results]),
        "ttft_ms": median([r.ttft_s for r in results]) * 1e3,
        "decode_tokens_per_s": median([x for r in results if (x := rate(r)) is not None]),
        "frontend_cpu_ms_per_token": median([x for x in cpu_ms if x == x]),
    }


def ratios(rows: list[dict[str, Any]]) -> str:
    """The headline: each prismgate target's ratios to ``vllm serve``, per concurrency."""
    lines = []
    for row in rows:
        if row["server"] == BASE:
            continue
        lines.append(
            f"{row['streams']:>2} streams  {row['server']:<52} decode x{row['decode_rate_ratio']:.3f}  "
            f"TTFT x{row['ttft_ratio']:.3f}  front-end CPU/token x{row['frontend_cpu_ratio']:.3f}"
        )
    return "\n".join(lines)


# --vllm-bench: what is read from each run of vLLM's client, and how it is shown
CLIENT_METRICS = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "median TTFT ms"),
    ("median_tpot_ms", "median TPOT ms"),
)


def client_runs(model: Path, servers: tuple[Server, ...], args: argparse.Namespace) -> dict[str, Any]:
    """``--vllm-bench``: vLLM's client against each server, rounds alternating, per concurrency."""
    cells: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []

    def one(server: Server, streams: int, prompts: int, output_len: int, seed: int) -> dict[str, Any] | None:
        print(f"\n== vllm bench serve -> {server.name}, {prompts} prompts, max concurrency {streams}", flush=True)
        argv = bench_argv(
            server.http_url, MODEL_NAME, model, prompts=prompts, input_len=args.input_len,
            output_len=output_len, concurrency=streams, seed=seed,
        )  # fmt: skip
        result = run_bench(argv)
        wrong = problems(result, prompts, output_len)
        if wrong:
            failed.append({"streams": streams, "server": server.name, "seed": seed, "why": wrong})
            print(f"FAILED: {server.name}: {'; '.join(wrong)}", flush=True)
            return None
        return {key: float(result[key]) for key, _ in CLIENT_METRICS}

    for server in servers:  # warm-up: compiled shapes, connections
        one(server, 1, 1, 4, seed=10_000)
    for streams in args.concurrency:
        prompts = args.num_prompts or 4 * streams
        runs: dict[str, list[dict[str, Any] | None]] = {s.name: [] for s in servers}
        for rep in range(args.reps):
            for server in servers if rep % 2 == 0 else servers[::-1]:
                runs[server.name].append(one(server, streams, prompts, args.max_tokens, seed=rep))
        cells.append({"streams": streams, "prompts": prompts, "runs": runs})
        print("\n" + side_by_side(cells[-1], servers), flush=True)
    return {"cells": cells, "failed_rounds": failed}


def side_by_side(cell: dict[str, Any], servers: tuple[Server, ...]) -> str:
    """One concurrency's runs: each metric's median over rounds (lowest-highest) per server, and each
    other server's ratio to the first (``vllm serve``)."""
    base = cell["runs"][servers[0].name]
    rows = []
    for key, label in CLIENT_METRICS:
        theirs = [r[key] if r else float("nan") for r in base]
        row: dict[str, Any] = {"metric": label}
        for server in servers:
            values = [r[key] if r else float("nan") for r in cell["runs"][server.name]]
            ok = [v for v in values if v == v]
            row[server.name] = f"{median(ok):.2f} ({min(ok):.2f}-{max(ok):.2f})" if ok else "failed"
            if server is servers[0]:
                continue
            low_high = spread(values, theirs)
            ratio = paired(values, theirs)
            row[f"ratio {server.name}"] = f"x{ratio:.3f} ({low_high[0]:.3f}-{low_high[1]:.3f})" if low_high else "n/a"
        rows.append(row)
    head = f"vLLM's client, {cell['prompts']} prompts, max concurrency {cell['streams']}, {len(base)} rounds:"
    columns = ["metric", *(s.name for s in servers), *(f"ratio {s.name}" for s in servers[1:])]
    return head + "\n" + table(rows, columns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--concept-pack", default=None, help="readouts pack (default: the default model's own)")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache of every server, GiB")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.25, help="each server's share of a GPU (three share it)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        help="weights dtype of every server (CPU: float32, bf16 is slow without AVX512-BF16; GPU: bfloat16)",
    )
    parser.add_argument("--results", default="vs_vllm", help="name of the results file in bench/results")
    parser.add_argument("--build", default="", help="what prismgate build was measured (kept in the results)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per generation (64; quick 32)")
    parser.add_argument("--reps", type=int, default=None, help="rounds per target per concurrency (9; quick 2)")
    parser.add_argument("--concurrency", default=None, help="streams at once (1,4,8; with --processes 64,256)")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="N > 1: vllm serve --api-server-count N and prismgate --workers N beside the single-process servers",
    )
    parser.add_argument(
        "--sae",
        default=None,
        help="prismgate's SAEs (its --sae) for the features target (default: the default model's shipped one; none)",
    )
    parser.add_argument(
        "--vllm-bench",
        action="store_true",
        help="measure vllm serve and prismgate with vLLM's own benchmark client (vllm bench serve), random dataset",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="--vllm-bench: requests per run (4 per stream)")
    parser.add_argument("--input-len", type=int, default=128, help="--vllm-bench: prompt tokens of each request")
    parser.add_argument(
        "--targets",
        default="vllm",
        help="--vllm-bench: prismgate servers beside vllm serve, comma-separated: vllm (--engine vllm), "
        "transformers (the embedded engine), transformers-eager (the same, --no-packed-weights)",
    )
    parser.add_argument(
        "--frontend-only",
        action="store_true",
        help="only `vllm serve` and prismgate's OpenAI SSE targets (no eager server, no Salience): the CPU comparison",
    )
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (32 if args.quick else 64)
    args.reps = args.reps or (2 if args.quick else 9)
    args.concurrency = [int(c) for c in (args.concurrency or ("64,256" if args.processes > 1 else "1,4,8")).split(",")]
    args.dtype = args.dtype or ("bfloat16" if _has_gpu() else "float32")
    args.targets = args.targets.split(",")
    if unknown := set(args.targets) - set(PRISMGATE_TARGETS):
        parser.error(f"--targets: unknown {sorted(unknown)}; known: {', '.join(PRISMGATE_TARGETS)}")

    try:
        import vllm
    except ImportError:
        print("vllm is not importable: run this with .venv-vllm/bin/python (make vllm-venv)", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from prismgate.compose import DEFAULT_PACK
    from prismgate.engines.models import default_model_path
    from prismgate.instruments.sae.auto import SHIPPED, sae_folders

    model = Path(args.model) if args.model else default_model_path()
    pack = Path(args.concept_pack) if args.concept_pack else (None if args.model else DEFAULT_PACK)
    # the default model's shipped SAE for the features target, which the main mode and --frontend-only
    # have ("auto" would look for one trained for the model's folder, which is given by path here)
    shipped_sae = not (args.model or args.processes > 1 or args.vllm_bench)
    shipped = ",".join(str(folder) for folder in sae_folders(SHIPPED))
    args.sae = None if args.sae == "none" else (args.sae or (shipped if shipped_sae else None))
    if args.vllm_bench:
        return _client_main(model, pack, args, vllm.__version__)
    prompt = list(AutoTokenizer.from_pretrained(str(model)).encode(PROMPT))
    if args.processes > 1:
        servers: contextlib.AbstractContextManager[tuple[Any, ...]] = _scaling_servers(model, pack, args)
        name = args.results if args.results != "vs_vllm" else "vs_vllm_processes"
        extra: dict[str, Any] = {"processes": args.processes}
    else:
        servers = _servers(model, pack, args)
        name = args.results
        extra = {"quick": args.quick, "frontend_only": args.frontend_only}
    with servers as running:
        load = [os.getloadavg()[0]]  # other work on the machine: the noise every ratio here carries
        rows, failed = asyncio.run(measure(running, prompt, args))
        load.append(os.getloadavg()[0])
    print("\nratios to `vllm serve` (its defaults):\n" + ratios(rows), flush=True)
    for f in failed:
        print(f"FAILED round {f['round']} at {f['streams']} streams, {f['server']}: {f['why']}", flush=True)
    path = write_results(
        name,
        {
            **extra,
            "build": args.build,
            "model": str(model),
            "vllm": vllm.__version__,
            "device": "cpu" if not _has_gpu() else "gpu",
            "settings": {"dtype": args.dtype, "max_model_len": args.max_len, "kv_cache_gb": args.kv_cache_gb},
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "load_average": load,
            "rows": rows,
            "failed_rounds": failed,
        },
    )
    print(f"results: {path}")
    return 1 if failed else 0


def _client_main(model: Path, pack: Path | None, args: argparse.Namespace, version: str) -> int:
    """``--vllm-bench``: ``vllm serve`` and prismgate up one after the other, then :func:`client_runs`."""
    with contextlib.ExitStack() as stack:
        gateways = [stack.enter_context(prismgate_serve(model, pack, args, target=t)) for t in args.targets]
        base = stack.enter_context(vllm_serve(model, args, eager=False))
        load = [os.getloadavg()[0]]
        measured = client_runs(model, (base, *gateways), args)
        load.append(os.getloadavg()[0])
    for f in measured["failed_rounds"]:
        print(f"FAILED at {f['streams']} streams, {f['server']}: {'; '.join(f['why'])}", flush=True)
    name = args.results if args.results != "vs_vllm" else "vs_vllm_bench_client"
    settings = {"dtype": args.dtype, "max_model_len": args.max_len, "kv_cache_gb": args.kv_cache_gb}
    path = write_results(
        name,
        {
            "client": f"vllm bench serve (vllm.benchmarks.serve, vllm {version}), random dataset, --ignore-eos, greedy",
            "model": str(model),
            "device": "cpu" if not _has_gpu() else "gpu",
            "settings": settings,
            "targets": args.targets,
            "input_len": args.input_len,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "load_average": load,
            **measured,
        },
    )
    print(f"results: {path}")
    return 1 if measured["failed_rounds"] else 0


@contextlib.contextmanager
def _servers(model: Path, pack: Path | None, args: argparse.Namespace) -> Iterator[tuple[Any, ...]]:
    """prismgate, ``vllm serve`` and its eager twin (unless ``--frontend-only``), started one at a time:
    three vLLM start-ups (each compiling) at once would starve each other. prismgate first: a
    setting it refuses stops the run before the others' minutes of compiling."""
    with (
        prismgate_serve(model, pack, args) as gateway,
        vllm_serve(model, args, eager=False) as base,
        contextlib.nullcontext(None) if args.frontend_only else vllm_serve(model, args, eager=True) as eager,
    ):
        yield base, eager, gateway


@contextlib.contextmanager
def _scaling_servers(model: Path, pack: Path | None, args: argparse.Namespace) -> Iterator[tuple[Any, ...]]:
    """``--processes N``: vllm serve with 1 and N API servers, prismgate with 1 and N front-ends."""
    with (
        vllm_serve(model, args, eager=False) as base,
        vllm_serve(model, args, eager=False, api_servers=args.processes) as api,
        prismgate_serve(model, pack, args) as gateway,
        prismgate_serve(model, pack, args, workers=args.processes) as gateway_workers,
    ):
        yield base, api, gateway, gateway_workers


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    raise SystemExit(main())
