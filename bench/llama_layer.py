"""A decode step with the engine's Llama layer forward, against transformers' own.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.llama_layer [--quick] [--rounds 9] [--batches 1,4,8]

SmolLM2 in bfloat16, loaded twice as the engine loads it (packed, decode attention), once with
:mod:`prismgate.engines.hf.llama_layer`'s forward and once with transformers'
``LlamaDecoderLayer.forward``, driven directly: B rows, each after its own ``--context``-token
prompt, decode ``--steps`` steps through the engine's merged batch cache (one row: alone); the
two alternate first from round to round. Both give the same bits (checked here on the first
step's logits). Prints the median ms per step of each and ours over transformers' per round;
results in ``llama_layer.json`` (not in ``make bench``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from typing import Any

from bench.common import decode_seconds, decode_step, default_model, prefill, spread, write_results


def _load(lean: bool) -> Any:
    from prismgate.engines.hf import llama_layer

    install = llama_layer.install
    if not lean:
        llama_layer.install = lambda model: "layers: transformers' forward (off for the benchmark)"  # type: ignore[assignment]
    try:
        return default_model("bfloat16").adapter
    finally:
        llama_layer.install = install  # type: ignore[assignment]


def _first_logits(adapter: Any, rows: int, context: int) -> Any:
    from prismgate.engines.hf.batch_cache import BatchCache

    caches = [prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(context)]) for row in range(rows)]
    return decode_step(adapter, BatchCache(adapter), caches, [100 + row for row in range(rows)], context)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, 1 and 4 rows")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", default="1,4,8", help="rows decoding together")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens before each row's steps")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batches = 3, "1,4"
    batches = [int(b) for b in args.batches.split(",")]
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    torch.set_grad_enabled(False)
    arms = {"ours": _load(lean=True), "transformers": _load(lean=False)}
    for rows in batches:
        ours, theirs = (_first_logits(arms[name], rows, args.context) for name in ("ours", "transformers"))
        if not torch.equal(ours, theirs):
            raise SystemExit(f"the two forwards gave other bits at {rows} rows")
    times: dict[int, dict[str, list[float]]] = {rows: {name: [] for name in arms} for rows in batches}
    for round_ in range(args.rounds):
        for rows in batches:
            for name in list(arms) if round_ % 2 == 0 else list(reversed(arms)):
                caches = [
                    prefill(arms[name], [7 + (i * 31 + row) % 300 for i in range(args.context)]) for row in range(rows)
                ]
                times[rows][name].append(1000 * decode_seconds(arms[name], caches, args.context, args.steps))
        print(f"round {round_ + 1}/{args.rounds}", flush=True)
    print("\n| rows | transformers' forward ms/step | ours ms/step | ours / transformers' |\n|---|---|---|---|")
    results = []
    for rows in batches:
        t = times[rows]
        ratios = [o / h for o, h in zip(t["ours"], t["transformers"], strict=True)]
        print(f"| {rows} | {spread(t['transformers'])} | {spread(t['ours'])} | {spread(ratios)} |")
        results.append({"rows": rows, **{f"{name}_ms": t[name] for name in arms}, "ratio": statistics.median(ratios)})
    write_results("llama_layer", {"cpu": cpu, "context": args.context, "steps": args.steps, "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
