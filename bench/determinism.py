"""Benchmark: what deterministic requests cost, in decode tokens/s (issue 22's goal: >= 0.85x, and >= 0.98x
for default-mode requests that run beside deterministic ones).

    .venv/bin/python -m bench.determinism [--quick] [--models smollm2,tiny] [--streams 1,4,8]

The transformers engine driven through ``SessionService`` in-process (no wire), greedy, ``N``
requests at once (their decode steps run as one batched forward pass), three ways, interleaved
round by round in rotating order:

* ``default``: no request asks for determinism;
* ``deterministic``: every request does (the pass runs the batch-invariant kernels);
* ``beside``: every other request does; the figure is that of the default-mode ones, which
  share every batched step with deterministic rows (not run at one stream).

A stream's rate is its decoded tokens over the time from its first decoded token to its last;
a round's figure is the mean over its streams of that kind. Ratios to ``default`` are taken
within each round and their median over rounds reported with their spread (min-max), so that a
load that drifts over the run cancels out. The load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import median, model_settings, serve, table, write_results

MODES = ("default", "deterministic", "beside")


async def one(service: Any, prompt: tuple[int, ...], spec: Any) -> float:
    """Decode tokens per second of one stream, from its first decoded token to its last."""
    from prismgate.core.actions import GenerateAction
    from prismgate.core.events import TokenEvent

    marks: list[float] = []
    async for event in service.run(GenerateAction(append_tokens=prompt, spec=spec, origin="bench")):
        if isinstance(event, TokenEvent) and not event.is_prefill:
            marks.append(time.perf_counter())
    return (len(marks) - 1) / (marks[-1] - marks[0])


async def round_of(service: Any, prompts: list[tuple[int, ...]], max_tokens: int, mode: str) -> float:
    """The mean per-stream rate of the round's default-mode streams (of all of them for ``deterministic``)."""
    from prismgate.core.actions import GenerateSpec

    wants = [mode == "deterministic" or (mode == "beside" and i % 2 == 1) for i in range(len(prompts))]
    specs = [GenerateSpec(max_tokens=max_tokens, ignore_eos=True, deterministic=w) for w in wants]
    rates = await asyncio.gather(*(one(service, p, s) for p, s in zip(prompts, specs, strict=True)))
    kept = [r for r, w in zip(rates, wants, strict=True) if w == (mode == "deterministic")]
    return statistics.fmean(kept)


async def measure(name: str, server: Any, streams: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    tokenizer = server.service.info().tokenizer
    prompts = [
        tuple(tokenizer.encode(f"Request {i}: the history of the lighthouse begins with the first fires"))
        for i in range(streams)
    ]
    modes = MODES if streams > 1 else MODES[:2]
    for mode in modes:  # warm-up
        await round_of(server.service, prompts, 8, mode)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.reps):
        for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            rates[mode].append(await round_of(server.service, prompts, args.max_tokens, mode))
    rows = []
    for mode in modes:
        ratios = [a / b for a, b in zip(rates[mode], rates["default"], strict=True)]
        rows.append(
            {
                "model": name,
                "streams": streams,
                "mode": mode,
                "tokens_per_s_per_stream": median(rates[mode]),
                "ratio_to_default": median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        )
    print(table(rows, list(rows[0])), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--streams", default="1,4,8", help="requests decoding at once, comma-separated (1,4,8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (64; quick 24)")
    parser.add_argument("--reps", type=int, default=None, help="rounds per mode (9; quick 3)")
    parser.add_argument("--results", default="determinism", help="name of the results file under bench/results/")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (24 if args.quick else 64)
    args.reps = args.reps or (3 if args.quick else 9)
    rows: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    for name in args.models.split(","):
        try:
            config = model_settings(name)
        except ValueError as exc:
            parser.error(str(exc))
        with serve(config) as server:
            for streams in (int(s) for s in args.streams.split(",")):
                rows += asyncio.run_coroutine_threadsafe(measure(name, server, streams, args), server.loop).result()
    load.append(os.getloadavg()[0])
    path = write_results(
        args.results,
        {"quick": args.quick, "max_tokens": args.max_tokens, "reps": args.reps, "load_average": load, "rows": rows},
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
