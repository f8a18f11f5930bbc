"""A decode step with keys and values appended in place, against transformers' cache, which copies itself to append.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.kv_room [--quick] [--rounds 9] [--depths 512,2048] [--batches 1,4,8]

transformers' ``DynamicCache`` appends each step's keys and values by concatenation, a copy of
every layer's whole cache per step; :mod:`prismgate.engines.hf.kv_room` writes them into room
kept in its buffers. On SmolLM2's adapter in bfloat16 (packed as the engine packs it), driven
directly: B rows, each after its own prompt of D tokens, decode ``--steps`` steps through the
engine's merged batch cache (one row: alone), once on each kind of cache (the prompts prefilled once
and copied into it); the kinds alternate
first from round to round. Prints the median ms per step of each, and kv_room's over
transformers' per round (median and spread); results in ``kv_room.json`` (not in ``make bench``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from typing import Any

from bench.common import decode_seconds, default_model, prefill, spread, write_results


def _step_ms(adapter: Any, prompts: list[Any], depth: int, steps: int) -> float:
    """Median ms of a decode step of a row per prefilled prompt, each copied into the adapter's kind of
    cache (the first step, which merges, untimed)."""
    caches = []
    for prompt in prompts:
        cache = adapter.new_cache()
        for index, layer in enumerate(prompt.layers):
            cache.update(layer.keys.clone(), layer.values.clone(), index)
        caches.append(cache)
    return 1000 * decode_seconds(adapter, caches, depth, steps)


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import DynamicCache

    from prismgate.engines.hf import kv_room

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, depth 512, 1 and 4 rows")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--depths", default="512,2048", help="prompt tokens before each row's steps")
    parser.add_argument("--batches", default="1,4,8", help="rows decoding together")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per measurement")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.depths, args.batches = 3, "512", "1,4"
    depths = [int(d) for d in args.depths.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    adapter = default_model("bfloat16", packed_weights=True).adapter
    config = adapter.model.config
    kinds = {
        "transformers": lambda: DynamicCache(config=config),
        "kv_room": lambda: kv_room.new_cache(config),
    }
    ms: dict[tuple[str, int, int], list[float]] = {}
    with torch.inference_mode():
        adapter.new_cache = kinds["transformers"]  # type: ignore[method-assign]
        prompts = {  # prefilled once, copied into each kind of cache for each measurement
            (depth, rows): [prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(depth)]) for row in range(rows)]
            for depth in depths
            for rows in batches
        }
        for round_ in range(args.rounds):
            order = list(kinds) if round_ % 2 == 0 else list(reversed(kinds))
            for depth in depths:
                for rows in batches:
                    for kind in order:
                        adapter.new_cache = kinds[kind]  # type: ignore[method-assign]
                        step = _step_ms(adapter, prompts[depth, rows], depth, args.steps)
                        ms.setdefault((kind, depth, rows), []).append(step)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    table = []
    print("\n| depth | rows | transformers ms/step | kv_room ms/step | kv_room / transformers |\n|---|---|---|---|---|")
    for depth in depths:
        for rows in batches:
            theirs, ours = ms["transformers", depth, rows], ms["kv_room", depth, rows]
            ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
            row = {
                "depth": depth,
                "rows": rows,
                "transformers_ms": statistics.median(theirs),
                "kv_room_ms": statistics.median(ours),
                "ratio": statistics.median(ratios),
                "ratio_spread": [min(ratios), max(ratios)],
            }
            table.append(row)
            print(f"| {depth} | {rows} | {row['transformers_ms']:.1f} | {row['kv_room_ms']:.1f} | {spread(ratios)} |")
    runs = [{"cache": k, "depth": d, "rows": r, "ms": v} for (k, d, r), v in ms.items()]
    write_results("kv_room", {"threads": torch.get_num_threads(), "args": vars(args), "runs": runs, "rows": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
