"""Benchmark 5: what concept steering costs, in decode tokens/s.

    .venv/bin/python -m bench.steering [--quick] [--models tiny,smollm2] [--batch 8]
    .venv-vllm/bin/python -m bench.steering --engine vllm [--quick] [--models tiny,smollm2]

The transformers engine (or, with ``--engine vllm``, the vLLM engine on its default compiled
path, steering in the graph), driven through ``SessionService`` in-process (no wire), greedy,
``--batch`` requests at once (so their decode steps run as one batched forward pass), three
ways, interleaved round by round:

* ``off``: no request steers;
* ``all``: every request steers with one vector (a pack concept at a middle pack layer,
  every position);
* ``mixed``: every other request steers, the rest do not: steered and unsteered rows share
  each batched step.

Tokens/s is the batch's decoded tokens over the time from its first decoded token to its
last; the figure is the median over rounds. A ratio to ``off`` is taken within each round
of three (the modes back to back, in rotating order) and its median over rounds reported,
so that a load that drifts over the run cancels out.
Beside it, tokens per CPU second of this process and its children (vLLM's engine core and
workers): on a shared machine other processes stretch the wall clock of a round, but not
the CPU time the gateway spends on it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Server, median, model_settings, serve, table, write_results

VLLM_SETTINGS = {"engine": "vllm", "vllm_kv_cache_gb": 1.0}  # vLLM's defaults otherwise: compiled, not eager

MODES = ("off", "all", "mixed")


async def one(service: Any, prompt: tuple[int, ...], spec: Any, marks: list[float]) -> int:
    from prismgate.core.actions import GenerateAction
    from prismgate.core.events import TokenEvent

    tokens = 0
    async for event in service.run(GenerateAction(append_tokens=prompt, spec=spec, origin="bench")):
        if isinstance(event, TokenEvent) and not event.is_prefill:
            tokens += 1
            marks.append(time.perf_counter())
    return tokens


def tree_cpu_s() -> float:
    """User + system CPU seconds of this process and all its children so far."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


async def round_of(service: Any, prompts: list[tuple[int, ...]], max_tokens: int, mode: str) -> tuple[float, float]:
    """(decoded tokens per second of wall time, per CPU second) of one round."""
    from prismgate.core.actions import GenerateSpec
    from prismgate.core.steering import SteeringEntry

    manifest = service.info().readouts
    layer = manifest.layers[len(manifest.layers) // 2]
    entry = SteeringEntry(layer=layer, scale=4.0, concept=manifest.concepts[0])
    specs = []
    for i in range(len(prompts)):
        steered = mode == "all" or (mode == "mixed" and i % 2 == 0)
        specs.append(
            GenerateSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, steering=(entry,) if steered else ())
        )
    marks: list[float] = []
    cpu = tree_cpu_s()
    counts = await asyncio.gather(*(one(service, p, s, marks) for p, s in zip(prompts, specs, strict=True)))
    cpu = tree_cpu_s() - cpu
    return (sum(counts) - len(prompts)) / (max(marks) - min(marks)), sum(counts) / max(cpu, 1e-9)


def paired(values: dict[str, list[float]], mode: str) -> float:
    """The median over rounds of ``mode``'s figure over ``off``'s in the same round."""
    return median([a / b for a, b in zip(values[mode], values["off"], strict=True)])


async def measure(name: str, server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    tokenizer = server.service.info().tokenizer
    prompts = [
        tuple(tokenizer.encode(f"Request {i}: the history of the lighthouse begins with the first fires"))
        for i in range(args.batch)
    ]
    for mode in MODES:  # warm-up
        await round_of(server.service, prompts, 8, mode)
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    per_cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
            rate, cpu_rate = await round_of(server.service, prompts, args.max_tokens, mode)
            rates[mode].append(rate)
            per_cpu[mode].append(cpu_rate)
    rows = [
        {
            "model": name,
            "engine": args.engine,
            "batch": args.batch,
            "steering": mode,
            "tokens_per_s": median(rates[mode]),
            "ratio_to_off": paired(rates, mode),
            "tokens_per_cpu_s": median(per_cpu[mode]),
            "cpu_ratio_to_off": paired(per_cpu, mode),
        }
        for mode in MODES
    ]
    print(table(rows, list(rows[0])), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--batch", type=int, default=8, help="requests decoding at once (8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (96; quick 32)")
    parser.add_argument("--reps", type=int, default=None, help="rounds per mode (7; quick 3)")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (32 if args.quick else 96)
    args.reps = args.reps or (3 if args.quick else 7)
    rows: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]  # other work on the machine: the noise every ratio here carries
    for name in args.models.split(","):
        try:
            config = model_settings(name)
        except ValueError as exc:
            parser.error(str(exc))
        if args.engine == "vllm":
            config = dataclasses.replace(config, **VLLM_SETTINGS)
        with serve(config) as server:
            rows += asyncio.run_coroutine_threadsafe(measure(name, server, args), server.loop).result()
    load.append(os.getloadavg()[0])
    path = write_results(
        "steering" if args.engine == "transformers" else f"steering_{args.engine}",
        {
            "quick": args.quick,
            "engine": args.engine,
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "reps": args.reps,
            "load_average": load,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
