"""What decode rows riding in a prompt chunk's pass save, against two passes.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.mixed_step [--quick] [--rounds 9] [--chunks 32,128,512]

While a prompt is prefilled in chunks and other requests decode, the transformers engine ran
two passes a round: the chunk, then a decode step of the waiting rows. Their steps now ride in
the chunk's pass (:mod:`prismgate.engines.hf.mixed_pass`). This times both on SmolLM2's adapter
in bfloat16 (packed as the engine packs it), driven directly, every row after a
``--context``-token prompt:

* ``two passes``: one forward of C prompt tokens after the prefix, then a decode step of the B
  rows (one row alone through the adapter, several through the engine's merged batch cache);
* ``mixed``: the same C tokens and B rows in one pass (``mixed_pass.forward``).

The chunk's cache is cut back to the prefix after each pass, so every pass sees the same depth;
the rows' caches grow by a token a pass. Per round and (C, B), ``--repeats`` passes each way,
alternating (rounds rotate the order), and their medians; the saving ``1 - mixed / two passes``, medians and the spread
over rounds (results in ``mixed_step.json``; not in ``make bench``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

from bench.common import default_model, prefill, write_results


class _Rows:
    """B decode rows, each after its own ``context``-token prompt, stepped together from one merged cache."""

    def __init__(self, adapter: Any, context: int, count: int) -> None:
        from prismgate.engines.hf.batch_cache import BatchCache

        self.adapter, self.batch = adapter, BatchCache(adapter)
        self.caches = [prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(context)]) for row in range(count)]
        self.position = context

    def step(self) -> None:
        """A decode step of the rows, in a pass of their own."""
        ids = [100 + row for row in range(len(self.caches))]
        if len(self.caches) == 1:
            self.adapter.forward(ids, self.caches[0], self.position, [], [], [0])
        else:
            self.batch.step(ids, self.caches, [self.position] * len(self.caches))
        self.position += 1

    def riders(self) -> Any:
        """The rows as riders of a chunk's pass (the engine's ``batched_decode.riders``)."""
        from prismgate.engines.hf.mixed_pass import Riders

        ids, positions = [100 + row for row in range(len(self.caches))], [self.position] * len(self.caches)
        if len(self.caches) == 1:
            return Riders(ids, positions, self.caches[0])
        self.batch.prepare(self.caches, positions)
        return Riders(ids, positions, self.batch.merged, self.batch.mask())

    def carried(self, riders: Any) -> None:
        if riders.cache is self.batch.merged:
            self.batch.advance()
        self.position += 1


def _pair(adapter: Any, cache: Any, context: int, chunk: int, rows: _Rows, repeats: int) -> tuple[float, float]:
    """Median seconds of the two passes and of the mixed one, ``repeats`` of each, alternating."""
    from prismgate.engines.hf import mixed_pass

    ids = [11 + i % 250 for i in range(chunk)]
    two, mixed = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        adapter.forward(ids, cache, context, [], [], [chunk - 1])
        rows.step()
        two.append(time.perf_counter() - started)
        cache.crop(-chunk)
        riders = rows.riders()
        started = time.perf_counter()
        mixed_pass.forward(adapter, [mixed_pass.Chunk(ids, cache, context, [chunk - 1])], riders)
        mixed.append(time.perf_counter() - started)
        rows.carried(riders)
        cache.crop(-chunk)
    return statistics.median(two), statistics.median(mixed)


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
    print(loaded.info.mixed_passes_reason, flush=True)
    adapter = loaded.adapter
    prefix = [7 + i % 300 for i in range(args.context)]
    seconds: dict[str, list[float]] = {}
    with torch.inference_mode():
        cache = prefill(adapter, prefix)
        cells = [(c, b) for c in chunks for b in batches]
        for round_ in range(args.rounds):
            for b in batches[round_ % len(batches) :] + batches[: round_ % len(batches)]:
                rows = _Rows(adapter, args.context, b)  # one set of rows a round, for every chunk size
                for c in chunks[round_ % len(chunks) :] + chunks[: round_ % len(chunks)]:
                    two, mixed = _pair(adapter, cache, args.context, c, rows, args.repeats)
                    seconds.setdefault(f"two {c} {b}", []).append(two)
                    seconds.setdefault(f"mixed {c} {b}", []).append(mixed)
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    table = []
    print("\n| C | B | two passes ms | mixed ms | mixed saves |")
    print("|---|---|---|---|---|")
    for c, b in cells:
        two, mixed = seconds[f"two {c} {b}"], seconds[f"mixed {c} {b}"]
        saves = [1 - m / t for m, t in zip(mixed, two, strict=True)]
        row = {
            "chunk": c,
            "rows": b,
            "two_passes_ms": 1000 * statistics.median(two),
            "mixed_ms": 1000 * statistics.median(mixed),
            "saves": statistics.median(saves),
            "saves_spread": [min(saves), max(saves)],
        }
        table.append(row)
        print(
            f"| {c} | {b} | {row['two_passes_ms']:.1f} | {row['mixed_ms']:.1f} | "
            f"{row['saves']:.0%} ({min(saves):.0%} to {max(saves):.0%}) |"
        )
    write_results(
        "mixed_step", {"threads": torch.get_num_threads(), "args": vars(args), "seconds": seconds, "rows": table}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
