"""Decode and prefill rates of the default model in bfloat16 and float32: what ``--dtype auto`` picks.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.dtype_choice [--quick] [--isa native,avx2]

SmolLM2's adapter, driven directly (no engine, no wire), loaded in both dtypes; rounds alternate
the two. Each instruction-set row runs in a process of its own: ``native`` is this CPU as it is,
``avx2`` the same CPU with oneDNN and ATen held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``,
``ATEN_CPU_CAPABILITY=avx2``), a stand-in for a CPU without AVX-512, AVX512-BF16 or AMX; it is
not that CPU (caches, clocks and memory differ), so the table names it as emulated. Prints a
table of medians, the spread over rounds, and float32 over bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

EMULATED = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def _measure(rounds: int, steps: int, prompt: int) -> dict[str, dict[str, list[float]]]:
    """{dtype: {"decode": tok/s per round, "prefill": tok/s per round}} in this process."""
    import torch

    from bench.common import default_model

    adapters = {dtype: default_model(dtype).adapter for dtype in ("bfloat16", "float32")}
    rates: dict[str, dict[str, list[float]]] = {d: {"decode": [], "prefill": []} for d in adapters}
    ids = [5 + i % 200 for i in range(prompt)]
    with torch.inference_mode():
        for round_ in range(rounds):
            order = list(adapters) if round_ % 2 == 0 else list(reversed(adapters))
            for dtype in order:
                adapter = adapters[dtype]
                cache = adapter.new_cache()
                started = time.perf_counter()
                for start in range(0, prompt, 512):
                    chunk = ids[start : start + 512]
                    adapter.forward(chunk, cache, start, [], [], [len(chunk) - 1])
                rates[dtype]["prefill"].append(prompt / (time.perf_counter() - started))
                started = time.perf_counter()
                for step in range(steps):
                    adapter.forward([100 + step], cache, prompt + step, [], [], [0])
                rates[dtype]["decode"].append(steps / (time.perf_counter() - started))
    return rates


def _row(isa: str, rates: dict[str, dict[str, list[float]]]) -> str:
    cells = [isa]
    for kind in ("decode", "prefill"):
        bf, f32 = rates["bfloat16"][kind], rates["float32"][kind]
        ratios = [b / a for a, b in zip(bf, f32, strict=True)]
        cells += [
            f"{statistics.median(bf):.1f} ({min(bf):.1f}-{max(bf):.1f})",
            f"{statistics.median(f32):.1f} ({min(f32):.1f}-{max(f32):.1f})",
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})",
        ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default="native,avx2", help="rows: native and/or avx2 (emulated)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round (batch 1)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens prefilled per round")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 8 steps")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 8
    if args.child:
        print(json.dumps(_measure(args.rounds, args.steps, args.prompt)))
        return 0
    print(f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(
        "| instruction sets | decode bf16 tok/s | decode f32 tok/s | f32/bf16 | prefill bf16 tok/s | "
        "prefill f32 tok/s | f32/bf16 |"
    )
    print("|---|---|---|---|---|---|---|")
    for isa in args.isa.split(","):
        env = {**os.environ, **EMULATED.get(isa, {})}
        child = [
            sys.executable,
            "-m",
            "bench.dtype_choice",
            "--child",
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--prompt",
            str(args.prompt),
        ]
        out = subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
        label = isa if isa == "native" else f"{isa} (emulated)"
        print(_row(label, json.loads(out.strip().splitlines()[-1])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
