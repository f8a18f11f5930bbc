"""What decode rows riding in a prefill chunk's forward would save, against two passes.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.mixed_step [--quick] [--rounds 9] [--chunks 32,128,512]

While a prompt is prefilled in chunks and other requests decode, the transformers engine runs
two passes a round: the chunk, then a decode step of the waiting rows. A decode step of a small
model at a few rows costs about what reading its weights costs, whatever the rows; the same
rows inside the chunk's forward would share its weight reads. This measures both sides on
SmolLM2's adapter in bfloat16 (packed as the engine packs it), driven directly:

* ``chunk C``: one forward of C prompt tokens after a ``--context``-token prefix (the cache cut
  back to the prefix after each, so every pass sees the same depth);
* ``chunk C+B``: the same with B more tokens, the proxy of a mixed pass (B rows more through
  every product and elementwise op; their attention is over the prefix and chunk, as a decode
  row's over its own context of that depth);
* ``decode B``: one decode step of B rows, each after a ``--context``-token prompt (B > 1
  through the engine's merged batch cache).

Per round and (C, B): the two-pass cost ``chunk C + decode B``, the mixed estimate ``chunk C+B``,
and what the mixed pass would save, ``1 - mixed / two passes``. Medians and the spread over
rounds, rounds rotating the order (results in ``mixed_step.json``; not in ``make bench``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

from bench.common import decode_seconds, default_model, prefill, write_results


def _chunk_s(adapter: Any, cache: Any, context: int, tokens: int, repeats: int) -> float:
    """Median seconds of one forward of ``tokens`` prompt tokens at depth ``context``."""
    times = []
    ids = [11 + i % 250 for i in range(tokens)]
    for _ in range(repeats):
        started = time.perf_counter()
        adapter.forward(ids, cache, context, [], [], [tokens - 1])
        times.append(time.perf_counter() - started)
        cache.crop(-tokens)  # back to the prefix
    return statistics.median(times)


def _decode_s(adapter: Any, context: int, rows: int, steps: int) -> float:
    """Median seconds of a decode step of ``rows`` rows, each after its own ``context``-token prompt (the
    merged cache kept from step to step, as the engine keeps it; its first step, which merges, untimed)."""
    caches = [prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(context)]) for row in range(rows)]
    return decode_seconds(adapter, caches, context, steps)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, chunks of 32 and 128, batches of 1 and 4")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--chunks", default="32,128,512", help="prefill chunk sizes C")
    parser.add_argument("--batches", default="1,4,8", help="decode rows B")
    parser.add_argument("--context", type=int, default=512, help="tokens before every chunk and decode row")
    parser.add_argument("--repeats", type=int, default=5, help="passes per measurement per round (their median)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.chunks, args.batches = 3, "32,128", "1,4"
    chunks = [int(c) for c in args.chunks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    loaded = default_model("bfloat16", packed_weights=True)
    print(f"packed: {loaded.info.packed_layers} layers, {loaded.info.packed_reason}", flush=True)
    adapter = loaded.adapter
    prefix = [7 + i % 300 for i in range(args.context)]
    seconds: dict[str, list[float]] = {}
    with torch.inference_mode():
        cache = prefill(adapter, prefix)
        kinds = [("chunk", c) for c in sorted({c + b for c in chunks for b in [0, *batches]})]
        kinds += [("decode", b) for b in batches]
        for round_ in range(args.rounds):
            shift = round_ % len(kinds)
            for kind, size in kinds[shift:] + kinds[:shift]:
                if kind == "chunk":
                    value = _chunk_s(adapter, cache, args.context, size, args.repeats)
                else:
                    value = _decode_s(adapter, args.context, size, args.repeats)
                seconds.setdefault(f"{kind} {size}", []).append(value)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    table = []
    print("\n| C | B | chunk C ms | decode B ms | two passes ms | chunk C+B ms | mixed saves |")
    print("|---|---|---|---|---|---|---|")
    for c in chunks:
        for b in batches:
            two = [x + y for x, y in zip(seconds[f"chunk {c}"], seconds[f"decode {b}"], strict=True)]
            mixed = seconds[f"chunk {c + b}"]
            saves = [1 - m / t for m, t in zip(mixed, two, strict=True)]
            row = {
                "chunk": c,
                "rows": b,
                "chunk_ms": 1000 * statistics.median(seconds[f"chunk {c}"]),
                "decode_ms": 1000 * statistics.median(seconds[f"decode {b}"]),
                "two_passes_ms": 1000 * statistics.median(two),
                "mixed_ms": 1000 * statistics.median(mixed),
                "saves": statistics.median(saves),
                "saves_spread": [min(saves), max(saves)],
            }
            table.append(row)
            print(
                f"| {c} | {b} | {row['chunk_ms']:.1f} | {row['decode_ms']:.1f} | {row['two_passes_ms']:.1f} | "
                f"{row['mixed_ms']:.1f} | {row['saves']:.0%} ({min(saves):.0%} to {max(saves):.0%}) |"
            )
    write_results(
        "mixed_step", {"threads": torch.get_num_threads(), "args": vars(args), "seconds": seconds, "rows": table}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
