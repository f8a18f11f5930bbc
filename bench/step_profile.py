"""Where a decode step's time goes: ``prismgate serve --engine vllm`` against ``vllm serve``, sampled.

    .venv-vllm/bin/python bench/step_profile.py [--quick] [--concurrency 1,4] [--seconds 30] [--reps 3]

Runs only in ``.venv-vllm`` (``make vllm-venv``). Both servers run at once, each in its own
process tree, with :mod:`bench.vs_vllm`'s settings (one OpenMP thread each, the same model,
dtype and KV cache). Targets alternate, a window each per round: ``vllm serve``, prismgate with
readouts off, prismgate with readouts on every generated token, all over OpenAI SSE, greedy,
``--max-tokens`` answers with ``ignore_eos``, the streams kept busy back to back.

During each window py-spy (installed from the package index into ``build/bench/tools`` when it
is not on PATH) samples every thread of the server's process tree at ``--rate`` per second;
py-spy leaves out a thread asleep in a system call, so a sample is time on a CPU (a thread
spinning while it waits counts). Each sample goes to the first category its stack matches
(:data:`CATEGORIES`), per process: vLLM's worker (its main thread: the model, the runner's
host code, prismgate's tap and side channel, the spin while it waits for the next step), its
engine core (scheduling, sending outputs, the spin while it waits for the worker), and the
front-end (every thread: vLLM's output processing, prismgate's side-channel receiver,
everything else). A category's time per decode step is its samples over the rate, over the
window's decode steps (tokens streamed in the window, from each answer's ``usage``, per
stream). Figures are medians over rounds. Sampling costs the servers CPU, so step times here
run above unprofiled ones (on 2 cores, by a third); the split is the point.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import vs_vllm
from bench.common import ROOT, median, table, write_results

PY_SPY = "py-spy==0.4.3"
TOOLS = ROOT / "build" / "bench" / "tools"

# (process, category, frames any one of which puts a sample there); first match wins, per process
CATEGORIES: list[tuple[str, str, tuple[str, ...]]] = [
    ("worker", "prismgate: plan rows, write steering", ("_Tap._before",)),
    ("worker", "prismgate: side channel send", ("Sender.send",)),
    ("worker", "prismgate: read readouts, build packet", ("_Tap._after",)),
    ("worker", "model forward", ("GPUModelRunner._model_forward", "CPUModelRunner._model_forward")),
    ("worker", "runner host code (inputs, sampling)", ("execute_model", "sample_tokens")),
    ("worker", "waiting for the next step", ()),
    ("engine core", "scheduling", ("Scheduler.schedule",)),
    ("engine core", "output update", ("update_from_output",)),
    ("engine core", "sending outputs (its thread)", ("process_output_sockets",)),
    ("engine core", "waiting for the worker", ("acquire_read", "collective_rpc", "process_input_sockets")),
    ("engine core", "other host code", ()),
    ("front-end", "prismgate: side channel receive and routing", ("Receiver._drain",)),
    ("front-end", "vLLM output processing", ("process_outputs", "output_handler", "_process_outputs")),
    ("front-end", "API, streaming and the rest", ()),
]
WORKER_TITLES = ("VLLM::Worker",)
ENGINE_TITLES = ("VLLM::EngineCore",)


def py_spy() -> str:
    """The py-spy binary: on PATH, or installed once under ``build/bench/tools``."""
    found = shutil.which("py-spy") or (str(TOOLS / "bin" / "py-spy") if (TOOLS / "bin" / "py-spy").exists() else None)
    if found:
        return found
    print(f"installing {PY_SPY} into {TOOLS}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(TOOLS), PY_SPY], check=True)
    return str(TOOLS / "bin" / "py-spy")


def role(stack: list[str]) -> str:
    """Which process a py-spy stack came from, by the innermost process title on it."""
    titles = [part for part in stack if part.startswith("process ")]
    title = titles[-1] if titles else ""
    if any(t in title for t in WORKER_TITLES):
        return "worker"
    if any(t in title for t in ENGINE_TITLES):
        return "engine core"
    return "front-end" if len(titles) <= 1 else "other"


def category(process: str, frames: list[str]) -> str:
    for proc, name, marks in CATEGORIES:
        if proc == process and (not marks or any(f.startswith(m) or f".{m}" in f for f in frames for m in marks)):
            return name
    return "other"


@dataclass
class Profile:
    """One window's samples: seconds on CPU per (process, category), and per thread."""

    rate: int
    samples: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    threads: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    @classmethod
    def read(cls, path: Path, rate: int) -> Profile:
        """py-spy's ``raw`` output: ``frame;frame;... count`` per line, outermost first, active threads
        only (py-spy leaves out a thread asleep in a system call). The worker's main thread, the engine
        core's threads and every thread of the front-end are categorised."""
        profile = cls(rate)
        for line in path.read_text().splitlines():
            stack_text, _, count = line.rpartition(" ")
            stack = stack_text.split(";")
            process = role(stack)
            thread = next((p for p in stack if p.startswith("thread ")), "thread ?")
            frames = [p.split(" (")[0] for p in stack if not p.startswith(("process ", "thread "))]
            profile.threads[(process, thread)] += int(count)
            if process == "worker" and "MainThread" not in thread:
                continue
            profile.samples[(process, category(process, frames))] += int(count)
        return profile

    def seconds_in(self, process: str, name: str) -> float:
        return self.samples.get((process, name), 0) / self.rate


@dataclass
class Window:
    target: str
    streams: int
    seconds: float
    tokens: float  # tokens streamed inside the window, all streams
    profile: Profile

    @property
    def steps(self) -> float:
        return self.tokens / self.streams

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps if self.steps else float("nan")

    def ms_per_step(self, process: str, name: str) -> float:
        return 1000 * self.profile.seconds_in(process, name) / self.steps if self.steps else float("nan")

    def ms_in(self, process: str) -> float:
        """Every category of ``process`` together, ms per step."""
        return sum(self.ms_per_step(process, name) for proc, name, _ in CATEGORIES if proc == process)


async def _load(
    client: Any, prompt: list[int], max_tokens: int, until: float, spans: list[tuple[float, float, int]]
) -> None:
    """One stream: requests back to back until ``until``; each answer's (start, end, usage tokens)."""
    while time.monotonic() < until:
        start = time.monotonic()
        result = await client(prompt, max_tokens)
        if result.usage_tokens != max_tokens:
            raise RuntimeError(f"an answer of {result.usage_tokens} tokens, {max_tokens} asked")
        spans.append((start, time.monotonic(), max_tokens))


def _in_window(spans: list[tuple[float, float, int]], lo: float, hi: float) -> float:
    """Tokens streamed between ``lo`` and ``hi``, each answer's spread evenly over its span."""
    total = 0.0
    for start, end, tokens in spans:
        overlap = min(end, hi) - max(start, lo)
        if overlap > 0 and end > start:
            total += tokens * overlap / (end - start)
    return total


def measure(
    spy: str, server: Any, target: str, extra: dict[str, Any], streams: int, prompt: list[int], args: argparse.Namespace
) -> Window:
    """Warm the streams up (OpenAI SSE with ``extra``), then sample the server's tree for ``--seconds``."""
    out = ROOT / "build" / "bench" / f"step_profile-{os.getpid()}.txt"
    spans: list[tuple[float, float, int]] = []
    warm = 5.0

    async def run() -> tuple[float, float]:
        client = vs_vllm.sse(server, **extra)  # its connections belong to this window's event loop
        until = time.monotonic() + warm + args.seconds + 1
        loads = [asyncio.create_task(_load(client, prompt, args.max_tokens, until, spans)) for _ in range(streams)]
        await asyncio.sleep(warm)
        lo = time.monotonic()
        command = [
            spy, "record", "--pid", str(server.pid), "--subprocesses", "--threads", "--nonblocking",
            "--rate", str(args.rate), "--format", "raw", "--duration", str(args.seconds), "-o", str(out),
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(*command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, err = await proc.communicate()
        hi = time.monotonic()
        if proc.returncode != 0:
            raise RuntimeError(f"py-spy failed: {err.decode()[-500:]}")
        await asyncio.gather(*loads)
        await client.client.aclose()  # type: ignore[attr-defined]
        return lo, hi

    lo, hi = asyncio.run(run())
    window = Window(target, streams, hi - lo, _in_window(spans, lo, hi), Profile.read(out, args.rate))
    out.unlink()
    return window


def summarize(windows: list[Window]) -> list[dict[str, Any]]:
    """Per target and stream count, the median over rounds of each category's ms per decode step."""
    rows = []
    for process, name, _ in CATEGORIES:
        row: dict[str, Any] = {"process": process, "category": name}
        for key in sorted({(w.streams, w.target) for w in windows}):
            mine = [w for w in windows if (w.streams, w.target) == key]
            row[f"{key[1]} @{key[0]}"] = round(median([w.ms_per_step(process, name) for w in mine]), 3)
        rows.append(row)
    step: dict[str, Any] = {"process": "", "category": "decode step (wall ms)"}
    off_cpu: dict[str, Any] = {"process": "worker", "category": "not on a CPU (waiting for a core)"}
    for key in sorted({(w.streams, w.target) for w in windows}):
        mine = [w for w in windows if (w.streams, w.target) == key]
        step[f"{key[1]} @{key[0]}"] = round(median([w.step_ms for w in mine]), 2)
        off_cpu[f"{key[1]} @{key[0]}"] = round(median([w.step_ms - w.ms_in("worker") for w in mine]), 3)
    return [step, *rows, off_cpu]


@contextlib.contextmanager
def _servers(args: argparse.Namespace) -> Iterator[tuple[Any, Any]]:
    from prismgate.compose import DEFAULT_PACK
    from prismgate.engines.models import default_model_path

    model = default_model_path()
    with (
        vs_vllm.prismgate_serve(model, DEFAULT_PACK, args) as gateway,
        vs_vllm.vllm_serve(model, args, eager=False) as base,
    ):
        yield base, gateway


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round of 10 s at one stream")
    parser.add_argument("--concurrency", default=None, help="streams at once (1,4; quick 1)")
    parser.add_argument("--seconds", type=int, default=None, help="sampled seconds per window (30; quick 10)")
    parser.add_argument("--reps", type=int, default=None, help="rounds (3; quick 1)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second per thread")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", help="every server's dtype (vs_vllm's CPU default)")
    parser.add_argument("--results", default="step_profile", help="name of the results file in bench/results")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in (args.concurrency or ("1" if args.quick else "1,4")).split(",")]
    args.seconds = args.seconds or (10 if args.quick else 30)
    args.reps = args.reps or (1 if args.quick else 3)
    # what vs_vllm's server helpers read
    args.max_len, args.kv_cache_gb, args.gpu_memory_utilization, args.sae = 2048, 1.0, 0.9, None
    try:
        import vllm
    except ImportError:
        print("vllm is not importable: run this with .venv-vllm/bin/python (make vllm-venv)", file=sys.stderr)
        return 2
    spy = py_spy()
    prompt = list(range(100, 132))
    windows: list[Window] = []
    with _servers(args) as (base, gateway):
        targets: list[tuple[str, Any, dict[str, Any]]] = [
            ("vllm serve", base, {}),
            ("prismgate, readouts off", gateway, {}),
            ("prismgate, readouts every token", gateway, {"readouts": True}),
        ]
        for rep in range(args.reps):
            for streams in args.concurrency:
                order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                for name, server, extra in order:
                    window = measure(spy, server, name, extra, streams, prompt, args)
                    windows.append(window)
                    print(f"round {rep + 1}, {streams} streams, {name}: {window.step_ms:.1f} ms/step", flush=True)
    rows = summarize(windows)
    print(table(rows, list(rows[0])))
    path = write_results(
        args.results,
        {
            "vllm": vllm.__version__,
            "dtype": args.dtype,
            "max_tokens": args.max_tokens,
            "seconds": args.seconds,
            "rate": args.rate,
            "rows": rows,
            "windows": [
                {
                    "target": w.target,
                    "streams": w.streams,
                    "seconds": w.seconds,
                    "tokens": w.tokens,
                    "samples": {f"{p} | {c}": n for (p, c), n in w.profile.samples.items()},
                    "threads": {f"{p} | {t}": n for (p, t), n in w.profile.threads.items()},
                }
                for w in windows
            ],
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
