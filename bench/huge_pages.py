"""The transformers engine's steps with its loaded weights moved into huge pages, against 4 KiB pages.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.huge_pages [--quick] [--rounds 9] [--batches 1,4,8]

:mod:`prismgate.engines.huge_pages` moves the loaded model into 2 MiB pages, for the whole
process, so each arm runs in a fresh process: SmolLM2's adapter in bfloat16, packed as the
engine packs it, loaded with ``huge_pages`` on and off, the arms alternating first from round to
round. Each measures ``--steps`` decode steps of B rows (each after its own 64-token prompt; one
row alone, several through the engine's merged batch cache) and the prefill of one 512-token
prompt. Prints the medians of each arm, on over off per round (median and spread), the move's
size and time and each arm's RSS after loading; results in ``huge_pages.json`` (not in ``make bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.common import decode_seconds, default_model, prefill, rss_bytes, spread, write_results

PROMPT = 64  # tokens before each decoding row: a short context, where reading the weights is most of a step
PREFILL = 512  # tokens of the prefill measured, in one chunk


def _measure(huge: bool, batches: list[int], steps: int) -> dict[str, Any]:
    """One arm in this process: load, then time decode steps at each row count and one prefill."""
    import torch

    loaded = default_model("bfloat16", packed_weights=True, huge_pages=huge)
    adapter = loaded.adapter
    result: dict[str, Any] = {
        "moved": loaded.info.huge_page_bytes,
        "reason": loaded.info.huge_pages_reason,
        "rss": rss_bytes(),
    }
    with torch.inference_mode():
        for rows in batches:
            caches = [prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(PROMPT)]) for row in range(rows)]
            result[f"decode_{rows}"] = 1000 * decode_seconds(adapter, caches, PROMPT, steps)
        ids = [11 + (i * 17) % 3000 for i in range(PREFILL)]
        prefill(adapter, ids[:32])  # the first forward of a shape pays its own set-up
        started = time.perf_counter()
        prefill(adapter, ids)
        result["prefill"] = PREFILL / (time.perf_counter() - started)
    return result


def _arm(huge: bool, batches: list[int], steps: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.huge_pages", "--arm", "on" if huge else "off"]
    command += ["--batches", ",".join(map(str, batches)), "--steps", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {'on' if huge else 'off'} arm failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, 1 and 4 rows")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", default="1,4,8", help="rows decoding together")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    parser.add_argument("--arm", choices=("on", "off"), help=argparse.SUPPRESS)  # one arm, in this process
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batches = 3, "1,4"
    batches = [int(b) for b in args.batches.split(",")]
    if args.arm is not None:
        print(json.dumps(_measure(args.arm == "on", batches, args.steps)))
        return 0
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        for arm in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            runs[arm].append(_arm(arm == "on", batches, args.steps))
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    metrics = [f"decode_{rows}" for rows in batches] + ["prefill"]
    table = []
    print("\n| measure | 4 KiB pages | huge pages | huge / 4 KiB |\n|---|---|---|---|")
    for metric in metrics:
        on, off = [r[metric] for r in runs["on"]], [r[metric] for r in runs["off"]]
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        name = f"decode ms/step, {metric.split('_')[1]} rows" if metric != "prefill" else "prefill tokens/s"
        table.append({"measure": name, "off": statistics.median(off), "on": statistics.median(on), "ratios": ratios})
        print(f"| {name} | {spread(off, '.1f')} | {spread(on, '.1f')} | {spread(ratios)} |")
    moved = [r["moved"] >> 20 for r in runs["on"]]
    rss = {arm: statistics.median(r["rss"] >> 20 for r in runs[arm]) for arm in runs}
    print(f"\nmoved {spread(moved, '.0f')} MiB ({runs['on'][0]['reason']}); RSS after loading {rss} MiB")
    write_results("huge_pages", {"args": vars(args), "runs": runs, "rows": table, "rss_mib": rss})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
