"""Decode tokens/s of the batched step at long contexts: the merge kept across steps against a merge per step.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.batch_decode [--quick] [--context 2000] [--batches 1,4,8] [--steps 24]

The adapter of the embedded SmolLM2 (bf16), driven directly (no engine, no wire): ``B``
sequences of ``--context`` tokens decode ``--steps`` tokens together, once through
:class:`~prismgate.engines.hf.batch_cache.BatchCache` (the engine's step: merged once, one
column appended per step) and once through the per-step merge it replaced
(``tests/engines/batch_reference.py``: every member's whole cache merged and copied back on
every step). Batch 1 is the step of its own (``adapter.forward``). Rounds alternate the two
and the median rate of each is printed, with their ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from bench.common import default_model
from prismgate.engines.hf.batch_cache import BatchCache
from tests.engines.batch_reference import per_step_merge


def _decode(adapter: Any, caches: list[Any], context: int, steps: int, kept: bool) -> float:
    """Tokens/s over all rows of ``steps`` batched steps."""
    batch = BatchCache(adapter)
    started = time.perf_counter()
    for step in range(steps):
        ids = [100 + step + row for row in range(len(caches))]
        positions = [context + step] * len(caches)
        if len(caches) == 1:
            adapter.forward(ids, caches[0], positions[0], [], [], [0])
        elif kept:
            batch.step(ids, caches, positions)
        else:
            per_step_merge(adapter, ids, caches, positions)
    elapsed = time.perf_counter() - started
    batch.leave_all()
    return steps * len(caches) / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round of 8 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 8
    adapter = default_model().adapter
    with torch.inference_mode():
        prefilled = adapter.new_cache()
        ids = [5 + i % 200 for i in range(args.context)]
        for start in range(0, args.context, 512):
            chunk = ids[start : start + 512]
            adapter.forward(chunk, prefilled, start, [], [], [len(chunk) - 1])
        print("| batch | per-step merge (tok/s) | merge kept (tok/s) | ratio |")
        print("|---|---|---|---|")
        for size in (int(b) for b in args.batches.split(",")):
            rates: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(args.rounds):
                for kept in (round_ % 2 == 0, round_ % 2 != 0):
                    caches = [copy.deepcopy(prefilled) for _ in range(size)]
                    rates[kept].append(_decode(adapter, caches, args.context, args.steps, kept))
                    del caches
            old, new = statistics.median(rates[False]), statistics.median(rates[True])
            print(f"| {size} | {old:.1f} | {new:.1f} | {new / old:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
