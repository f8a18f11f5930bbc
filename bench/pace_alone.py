"""A long prompt's prefill alone: chunks bounded by time (2.5 targets) against the old rule (full chunks).

    .venv/bin/python -m bench.pace_alone [--quick] [--rounds 9] [--prompt 3516]

The transformers engine with the default model and settings, in this process. Alone, a prompt's
chunks now last up to :data:`prismgate.engines.hf.pace.ALONE` targets, so that a newcomer waits
for at most that (``bench/hostile.py --only 10`` measures the wait); before, a prompt alone ran
``prefill_chunk`` tokens a step however long that took. Per round, each rule prefills the same
``--prompt``-token prompt (one token generated), the rules alternating first; a plain prompt and
one whose every position is scored (top-20 logprobs) and read out. Prints the prompt tokens/s of
each, medians, spread, and bounded over full per round, and writes
``bench/results/pace_alone.json``; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from typing import Any

RULES = {"bounded": None, "full": 1e6}  # None: the module's ALONE; 1e6 targets: always the ceiling


async def _prefill(engine: Any, tokens: tuple[int, ...], scored: bool) -> float:
    from prismgate.core.actions import GenerateSpec, PositionRange
    from prismgate.core.engine import EngineRequest

    n = len(tokens)
    outputs: dict[str, Any] = {}
    if scored:
        ranges = (PositionRange(1, n + 1),)
        outputs = {"logprob_top_k": 20, "logprob_ranges": ranges, "readout_ranges": (PositionRange(0, n + 1),)}
    spec = GenerateSpec(max_tokens=1, **outputs)
    request = EngineRequest(request_id=str(time.monotonic_ns()), tokens=tokens, spec=spec)
    started = time.perf_counter()
    async for _ in engine.generate(request):
        pass
    return n / (time.perf_counter() - started)


async def _run(args: argparse.Namespace) -> None:
    from bench.common import settings, write_results
    from prismgate.compose import build_engine
    from prismgate.engines.hf import TransformersEngine, pace

    engine = build_engine(settings())  # the default model and its concept pack, as `prismgate serve` runs them
    if not isinstance(engine, TransformersEngine):
        raise SystemExit("the default model and its pack are not built yet: run `make serve` once first")
    await engine.start()
    alone = pace.ALONE
    tokens = tuple(5 + i % 200 for i in range(args.prompt))
    rates: dict[tuple[str, bool], list[float]] = {}
    try:
        for round_ in range(args.rounds):
            order = list(RULES) if round_ % 2 == 0 else list(reversed(RULES))
            for scored in (False, True):
                for rule in order:
                    pace.ALONE = RULES[rule] or alone
                    engine._scheduler.pace = type(engine._scheduler.pace)(  # forget the measured costs
                        ceiling=engine._scheduler.pace.ceiling, target_s=engine._scheduler.pace.target_s
                    )
                    rates.setdefault((rule, scored), []).append(await _prefill(engine, tokens, scored))
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    finally:
        pace.ALONE = alone
        await engine.close()
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; prompt tokens/s alone")
    print("| prompt | bounded | full | bounded/full |\n|---|---|---|---|")
    for scored in (False, True):
        bounded, full = rates["bounded", scored], rates["full", scored]
        ratios = [b / f for b, f in zip(bounded, full, strict=True)]
        print(
            f"| {'scored, read out' if scored else 'plain'} "
            f"| {statistics.median(bounded):.0f} ({min(bounded):.0f}-{max(bounded):.0f}) "
            f"| {statistics.median(full):.0f} ({min(full):.0f}-{max(full):.0f}) "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    runs = [{"rule": rule, "scored": scored, "tokens_per_s": values} for (rule, scored), values in rates.items()]
    print(write_results("pace_alone", {"prompt_tokens": args.prompt, "alone_targets": alone, "runs": runs}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--prompt", type=int, default=3516)
    parser.add_argument("--quick", action="store_true", help="three rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 3
    asyncio.run(_run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
