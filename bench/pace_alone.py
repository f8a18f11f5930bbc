"""A long prompt's prefill alone: chunks bounded by time (2.5 targets) against full chunks, and against before.

    .venv/bin/python -m bench.pace_alone [--quick] [--rounds 9] [--prompt 3516]

The transformers engine with the default model and settings, in this process. Alone, a prompt's
chunks now last up to :data:`prismgate.engines.hf.pace.ALONE` targets, so that a newcomer waits
for at most that (``bench/hostile.py --only 10`` measures the wait); before, a prompt alone ran
``prefill_chunk`` tokens a step however long that took, its chunks' attention went through
transformers' own SDPA path, which copies the cache's key heads for every chunk
(:mod:`prismgate.engines.hf.chunk_attention` does without), and its cache was transformers' own,
which copies itself to append (:mod:`prismgate.engines.hf.kv_room` appends in place): the rule
``before`` is all three. Per
round, each rule prefills the same ``--prompt``-token prompt (one token generated), the rules
rotating first; a plain prompt and one whose every position is scored (top-20 logprobs) and read
out. Prints the prompt tokens/s of each, medians, spread, and bounded over full and over before
per round, and writes ``bench/results/pace_alone.json``; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from typing import Any

# rule -> (targets a step alone may last, chunk attention and cache without copies); None: the
# module's ALONE, 1e6 targets: always the ceiling
RULES: dict[str, tuple[float | None, bool]] = {"bounded": (None, True), "full": (1e6, True), "before": (1e6, False)}


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
    from transformers import DynamicCache

    from bench.common import settings, spread, write_results
    from prismgate.compose import build_engine
    from prismgate.engines.hf import TransformersEngine, chunk_attention, kv_room, pace

    engine = build_engine(settings())  # the default model and its concept pack, as `prismgate serve` runs them
    if not isinstance(engine, TransformersEngine):
        raise SystemExit("the default model and its pack are not built yet: run `make serve` once first")
    await engine.start()
    alone, takes, new_cache = pace.ALONE, chunk_attention.takes, kv_room.new_cache
    tokens = tuple(5 + i % 200 for i in range(args.prompt))
    rates: dict[tuple[str, bool], list[float]] = {}
    try:
        for round_ in range(args.rounds):
            shift = round_ % len(RULES)
            order = list(RULES)[shift:] + list(RULES)[:shift]
            for scored in (False, True):
                for rule in order:
                    targets, without_copies = RULES[rule]
                    pace.ALONE = targets or alone
                    chunk_attention.takes = takes if without_copies else (lambda *args: False)  # type: ignore[assignment]
                    kv_room.new_cache = new_cache if without_copies else (lambda config: DynamicCache(config=config))
                    engine._scheduler.pace = type(engine._scheduler.pace)(  # forget the measured costs
                        ceiling=engine._scheduler.pace.ceiling, target_s=engine._scheduler.pace.target_s
                    )
                    rates.setdefault((rule, scored), []).append(await _prefill(engine, tokens, scored))
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    finally:
        pace.ALONE, chunk_attention.takes, kv_room.new_cache = alone, takes, new_cache  # type: ignore[assignment]
        await engine.close()
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; prompt tokens/s alone")
    print("| prompt | bounded | full | before | bounded/full | bounded/before |\n|---|---|---|---|---|---|")
    for scored in (False, True):
        cells = [spread(rates[rule, scored], ".0f") for rule in RULES]
        bounded = rates["bounded", scored]
        for rule in ("full", "before"):
            cells.append(spread([b / o for b, o in zip(bounded, rates[rule, scored], strict=True)], ".2f"))
        print(f"| {'scored, read out' if scored else 'plain'} | " + " | ".join(cells) + " |")
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
