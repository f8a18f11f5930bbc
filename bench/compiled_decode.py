"""What compiling the model would buy the transformers engine's decode step: SmolLM2 in bfloat16,
packed and eager (what the engine runs) against the unpacked model compiled by inductor with
weight freezing (inductor packs the weights itself).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.compiled_decode [--quick] [--rounds 9] [--batches 1,4]

Both arms are driven through the engine's adapter (`forward` for one row, the merged batch cache
for more), on a 64-token prompt per row, ``--steps`` decode steps per batch size per round, rounds
alternating; no hooks, readouts or steering (the engine's compiled path does not exist: this
measures what one could gain). Prints the first compile's seconds, ms per step (medians and
spread), compiled over eager per round, and how far the compiled logits are from the eager ones
(results in ``compiled_decode.json``; not in `make bench`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.common import decode_step, default_model, prefill, spread, write_results

CONTEXT = 64


def _caches(adapter: Any, rows: int) -> list[Any]:
    return [prefill(adapter, [7 + (i * 31 + row) % 300 for i in range(CONTEXT)]) for row in range(rows)]


def _steps(adapter: Any, rows: int, steps: int) -> tuple[float, torch.Tensor]:
    """ms per decode step of ``rows`` rows, and the first step's float32 logits."""
    from prismgate.engines.hf.batch_cache import BatchCache

    caches, merged, first = _caches(adapter, rows), BatchCache(adapter), None
    started = time.perf_counter()
    for step in range(steps):
        ids = [100 + step + row for row in range(rows)]
        logits = decode_step(adapter, merged, caches, ids, CONTEXT + step).to(torch.float32)
        first = logits if first is None else first
    assert first is not None
    return (time.perf_counter() - started) / steps * 1e3, first


def main(argv: list[str] | None = None) -> int:
    import torch._inductor.config as inductor

    from prismgate.engines.hf.adapters import ModelAdapter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 16 steps")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batches", default="1,4")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 16
    inductor.freezing = True
    torch.set_grad_enabled(False)
    eager = default_model("bfloat16").adapter
    plain = default_model("bfloat16", packed_weights=False).adapter
    compiled = ModelAdapter(torch.compile(plain.model, dynamic=True), plain.tokenizer, plain.device)
    arms = {"packed eager": eager, "compiled": compiled}
    batches = [int(b) for b in args.batches.split(",")]
    compile_s: dict[str, float] = {}
    for rows in batches:
        started = time.perf_counter()
        _steps(compiled, rows, 2)
        compile_s[str(rows)] = time.perf_counter() - started
        print(f"first steps of {rows} row(s), compiling: {compile_s[str(rows)]:.1f} s", flush=True)
    times: dict[str, dict[str, list[float]]] = {str(rows): {arm: [] for arm in arms} for rows in batches}
    gaps: dict[str, float] = {}
    for round_ in range(args.rounds):
        for rows in batches:
            firsts = {}
            for arm in list(arms) if round_ % 2 == 0 else list(reversed(arms)):
                ms, firsts[arm] = _steps(arms[arm], rows, args.steps)
                times[str(rows)][arm].append(ms)
            gaps[str(rows)] = float((firsts["compiled"] - firsts["packed eager"]).abs().max())
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(
        "| rows | packed eager ms/step | compiled ms/step | compiled / eager | largest logit gap |\n"
        "|---|---|---|---|---|"
    )
    for rows in batches:
        cell = times[str(rows)]
        ratios = [c / e for c, e in zip(cell["compiled"], cell["packed eager"], strict=True)]
        print(
            f"| {rows} | {spread(cell['packed eager'])} | {spread(cell['compiled'])} | {spread(ratios)} "
            f"| {gaps[str(rows)]:.3f} |"
        )
    write_results("compiled_decode", {"args": vars(args), "compile_s": compile_s, "ms_per_step": times, "gaps": gaps})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
