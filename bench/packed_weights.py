"""Decode and prefill rates of the default model in bfloat16 with its weights packed and eager.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.packed_weights [--quick] [--rounds 9] [--batches 1,4,8]

SmolLM2's adapter, driven directly (no engine, no wire), loaded three times in bfloat16: packed
as the engine packs it (:mod:`prismgate.engines.hf.packing`: siblings that read one input share
one product), packed with every layer apart, and eager; rounds alternate the order.
Per round: a ``--prompt``-token prefill in 512-token chunks (its tokens/s), then ``--steps``
decode steps of each batch size of ``--batches`` (batches of more than one through the engine's
merged batch cache), tokens/s over every row. Prints medians, the spread over rounds, and each
arm over eager per round (results in ``packed_weights.json``); the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

from bench.common import decode_step, default_model, prefill, spread, write_results

ARMS = ("packed", "apart", "eager")  # as the engine packs; packed with siblings apart; not packed


def _load(arm: str) -> Any:
    from prismgate.engines.hf import packing

    loaded = default_model("bfloat16", packed_weights=arm == "packed")
    if arm == "apart":
        print(f"apart: {packing.pack(loaded.adapter.model, fuse=False)}", flush=True)
    else:
        print(f"{arm}: {loaded.info.packed_layers} layers, {loaded.info.packed_reason}", flush=True)
    return loaded.adapter


def _prefill_rate(adapter: Any, ids: list[int]) -> float:
    """Prompt tokens/s of ``ids`` prefilled in 512-token chunks."""
    started = time.perf_counter()
    prefill(adapter, ids)
    return len(ids) / (time.perf_counter() - started)


def _decode(adapter: Any, batch: int, steps: int, context: int) -> float:
    """Tokens/s of ``steps`` decode steps of ``batch`` rows, each row after a ``context``-token prompt."""
    from prismgate.engines.hf.batch_cache import BatchCache

    caches = [prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(context)]) for row in range(batch)]
    merged = BatchCache(adapter)
    started = time.perf_counter()
    for step in range(steps):
        decode_step(adapter, merged, caches, [100 + step + row for row in range(batch)], context + step)
    return batch * steps / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, a 1,024-token prompt, 16 steps")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per batch size per round")
    parser.add_argument("--batches", default="1,4,8", help="decode batch sizes")
    parser.add_argument("--prompt", type=int, default=3500, help="prompt tokens prefilled per round")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens before each decode row")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.prompt, args.steps = 3, 1024, 16
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    adapters = {arm: _load(arm) for arm in ARMS}
    rates: dict[str, dict[str, list[float]]] = {name: {} for name in adapters}
    ids = [5 + i % 200 for i in range(args.prompt)]
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for name in ARMS[round_ % 3 :] + ARMS[: round_ % 3]:
                adapter = adapters[name]
                rates[name].setdefault("prefill", []).append(_prefill_rate(adapter, ids))
                for batch in batches:
                    rate = _decode(adapter, batch, args.steps, args.context)
                    rates[name].setdefault(f"decode x{batch}", []).append(rate)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print("\n| tokens/s | packed | apart | eager | packed/apart | packed/eager |\n|---|---|---|---|---|---|")
    for kind in rates["packed"]:
        cells = [spread(rates[arm][kind], ".1f") for arm in ARMS]
        for other in ("apart", "eager"):
            ratios = [p / o for p, o in zip(rates["packed"][kind], rates[other][kind], strict=True)]
            cells.append(spread(ratios, ".2f"))
        print(f"| {kind} | " + " | ".join(cells) + " |")
    write_results("packed_weights", {"threads": torch.get_num_threads(), "args": vars(args), "rates": rates})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
