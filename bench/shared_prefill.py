"""What sharing a pass saves the transformers engine: prompts prefilled together, and decode batches beyond one.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.shared_prefill [--quick] [--rounds 9]

Two measurements on SmolLM2 in bfloat16 (packed as the engine packs it), one thread:

* ``forward``: K prompts of ``--prompt`` tokens, each first in a new cache, prefilled in a pass
  each (``ModelAdapter.forward``) and in one pass (``mixed_pass.forward``), alternating; ms per
  round, medians and spread of ``one / each``.
* ``engine``: the engine in process (``prismgate.compose.build_engine``, as ``prismgate serve``
  runs it), ``--streams`` requests of ``--short`` prompt tokens and ``--tokens`` answer tokens
  submitted at once, under three rules alternating: as it runs (``shared``); newcomers' prompts
  a pass each (``a pass each``); and at most one batched pass of ``max_batch`` requests a round
  besides the decode rows that rode, the rest a pass per request (``one batch``: the rule before
  further batches, but that a round whose steps rode may now run one more batch). Per rule: tokens/s, the median time to
  first token and between tokens, medians over rounds with their spread.

Results in ``shared_prefill.json``; not in ``make bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from typing import Any

from bench.common import default_model, settings, spread, write_results

RULES = ("shared", "a pass each", "one batch")


def _forward(adapter: Any, count: int, length: int) -> tuple[float, float]:
    """Seconds to prefill ``count`` prompts of ``length`` tokens in a pass each, and in one pass."""
    from prismgate.engines.hf import mixed_pass

    prompts = [[11 + (i * 7 + j * 13) % 250 for i in range(length)] for j in range(count)]
    started = time.perf_counter()
    for prompt in prompts:
        adapter.forward(prompt, adapter.new_cache(), 0, [], [], [length - 1])
    each = time.perf_counter() - started
    chunks = [mixed_pass.Chunk(prompt, adapter.new_cache(), 0, [length - 1]) for prompt in prompts]
    started = time.perf_counter()
    mixed_pass.forward(adapter, chunks, None)
    return each, time.perf_counter() - started


async def _streams(engine: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """``args.streams`` requests at once: tokens/s, and the median TTFT and time between tokens (s)."""
    import random

    from prismgate.core.actions import GenerateSpec
    from prismgate.core.engine import EngineRequest
    from prismgate.core.events import TokenEvent

    rng = random.Random(seed)

    async def one(index: int) -> tuple[float, float, int]:
        tokens = tuple(rng.randrange(100, 20000) for _ in range(args.short))
        spec = GenerateSpec(max_tokens=args.tokens, ignore_eos=True)
        request = EngineRequest(request_id=f"{seed}-{index}", tokens=tokens, spec=spec)
        begun, times = time.perf_counter(), []
        async for event in engine.generate(request):
            if isinstance(event, TokenEvent):
                times.append(time.perf_counter())
        return times[0] - begun, (times[-1] - times[0]) / (len(times) - 1), len(times)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(args.streams)))
    seconds = time.perf_counter() - started
    return {
        "tokens_per_s": sum(n for _, _, n in results) / seconds,
        "ttft_s": statistics.median(r[0] for r in results),
        "tpot_s": statistics.median(r[1] for r in results),
    }


class _Rules:
    """Puts the engine's scheduler under one of :data:`RULES` (see the module docstring)."""

    def __init__(self, engine: Any) -> None:
        from prismgate.engines.hf import scheduler as module

        self.engine, self.module, self.groups = engine, module, module.batch_groups

    def apply(self, rule: str) -> None:
        scheduler, groups = self.engine._scheduler, self.groups
        scheduler.__dict__.pop("_together", None)
        self.module.batch_groups = groups
        if rule == "a pass each":
            scheduler._together = lambda *_args: []
        elif rule == "one batch":
            self.module.batch_groups = lambda *args, **kw: groups(*args, **kw)[:1]


async def _engine_rounds(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    from prismgate.compose import build_engine

    engine = build_engine(settings(dtype="bfloat16"))
    await engine.start()
    rules = _Rules(engine)
    runs: dict[str, list[dict[str, float]]] = {rule: [] for rule in RULES}
    try:
        await _streams(engine, args, -1)  # warm: the pace measures its rates
        for round_ in range(args.rounds):
            for rule in RULES[round_ % len(RULES) :] + RULES[: round_ % len(RULES)]:
                rules.apply(rule)
                runs[rule].append(await _streams(engine, args, round_))
            print(f"engine round {round_ + 1}/{args.rounds} done", flush=True)
    finally:
        rules.apply("shared")
        await engine.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds, 2 and 4 prompts, 16 streams")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--prompts", default="2,4,8", help="prompts prefilled together (forward)")
    parser.add_argument("--prompt", type=int, default=64, help="tokens a prompt (forward)")
    parser.add_argument("--streams", type=int, default=32, help="requests at once (engine)")
    parser.add_argument("--short", type=int, default=16, help="prompt tokens a request (engine)")
    parser.add_argument("--tokens", type=int, default=32, help="answer tokens a request (engine)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.prompts, args.streams = 3, "2,4", 16
    counts = [int(c) for c in args.prompts.split(",")]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    adapter = default_model("bfloat16").adapter
    seconds: dict[int, tuple[list[float], list[float]]] = {count: ([], []) for count in counts}
    with torch.inference_mode():
        _forward(adapter, 2, args.prompt)
        for round_ in range(args.rounds):
            for count in counts[round_ % len(counts) :] + counts[: round_ % len(counts)]:
                each, one = _forward(adapter, count, args.prompt)
                seconds[count][0].append(each)
                seconds[count][1].append(one)
    forward = []
    print(
        f"\n{args.prompt}-token prompts, {args.rounds} rounds\n| prompts | a pass each ms | one pass ms | one / each |"
    )
    print("|---|---|---|---|")
    for count, (each, one) in seconds.items():
        ratios = [o / e for o, e in zip(one, each, strict=True)]
        row = {"prompts": count, "each_ms": 1000 * statistics.median(each), "one_ms": 1000 * statistics.median(one)}
        forward.append({**row, "ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)]})
        print(f"| {count} | {row['each_ms']:.1f} | {row['one_ms']:.1f} | {spread(ratios)} |")
    del adapter
    runs = asyncio.run(_engine_rounds(args))
    print(f"\n{args.streams} requests of {args.short} + {args.tokens} tokens at once, {args.rounds} rounds")
    print("| rule | tokens/s | TTFT s | between tokens s |\n|---|---|---|---|")
    for rule, results in runs.items():
        cells = [spread([r[key] for r in results]) for key in ("tokens_per_s", "ttft_s", "tpot_s")]
        print(f"| {rule} | " + " | ".join(cells) + " |")
    path = write_results("shared_prefill", {"settings": vars(args), "forward": forward, "engine": runs})
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
