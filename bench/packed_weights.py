"""Decode and prefill rates of the default model in bfloat16 with its weights packed and eager.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.packed_weights [--rounds 9] [--batches 1,4,8]

SmolLM2's adapter, driven directly (no engine, no wire), loaded twice in bfloat16: with
``packed_weights`` (:mod:`prismgate.engines.hf.packing`) and without; rounds alternate the two.
Per round: a ``--prompt``-token prefill in 512-token chunks (its tokens/s), then ``--steps``
decode steps of each batch size of ``--batches`` (batches of more than one through the engine's
merged batch cache), tokens/s over every row. Prints medians, the spread over rounds, and packed
over eager per round; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

from bench.common import default_model


def _load(packed: bool) -> Any:
    loaded = default_model("bfloat16", packed_weights=packed)
    print(f"packed={packed}: {loaded.info.packed_layers} layers, {loaded.info.packed_reason}", flush=True)
    return loaded.adapter


def _prefill(adapter: Any, ids: list[int]) -> tuple[Any, float]:
    cache = adapter.new_cache()
    started = time.perf_counter()
    for start in range(0, len(ids), 512):
        chunk = ids[start : start + 512]
        adapter.forward(chunk, cache, start, [], [], [len(chunk) - 1])
    return cache, len(ids) / (time.perf_counter() - started)


def _decode(adapter: Any, batch: int, steps: int, context: int) -> float:
    """Tokens/s of ``steps`` decode steps of ``batch`` rows, each row after a ``context``-token prompt."""
    from prismgate.engines.hf.batch_cache import BatchCache

    caches = [_prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(context)])[0] for row in range(batch)]
    merged = BatchCache(adapter)
    started = time.perf_counter()
    for step in range(steps):
        position = context + step
        if batch == 1:
            adapter.forward([100 + step], caches[0], position, [], [], [0])
        else:
            merged.step([100 + step + row for row in range(batch)], caches, [position] * batch)
    return batch * steps / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per batch size per round")
    parser.add_argument("--batches", default="1,4,8", help="decode batch sizes")
    parser.add_argument("--prompt", type=int, default=3500, help="prompt tokens prefilled per round")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens before each decode row")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    adapters = {"packed": _load(True), "eager": _load(False)}
    rates: dict[str, dict[str, list[float]]] = {name: {} for name in adapters}
    ids = [5 + i % 200 for i in range(args.prompt)]
    with torch.inference_mode():
        for round_ in range(args.rounds):
            for name in list(adapters) if round_ % 2 == 0 else list(reversed(adapters)):
                adapter = adapters[name]
                rates[name].setdefault("prefill", []).append(_prefill(adapter, ids)[1])
                for batch in batches:
                    rate = _decode(adapter, batch, args.steps, args.context)
                    rates[name].setdefault(f"decode x{batch}", []).append(rate)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print("\n| tokens/s | packed | eager | packed/eager |\n|---|---|---|---|")
    for kind in rates["packed"]:
        packed, eager = rates["packed"][kind], rates["eager"][kind]
        ratios = [p / e for p, e in zip(packed, eager, strict=True)]
        print(
            f"| {kind} | {statistics.median(packed):.1f} ({min(packed):.1f}-{max(packed):.1f}) "
            f"| {statistics.median(eager):.1f} ({min(eager):.1f}-{max(eager):.1f}) "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
