"""Benchmark 4: what concept readouts cost, in decode tokens/s.

    .venv/bin/python -m bench.readouts [--quick] [--models tiny,smollm2]

The transformers engine, driven through ``SessionService`` in-process (no wire), greedy,
the same prompt each time, three ways, interleaved:

* ``off``: no readout ranges;
* ``every``: readouts for every generated position;
* ``few``: readouts for 4 positions spread over the answer.

Models: ``tiny`` (the tests' tiny random Llama with a random 2-layer x 3-concept pack) and
``smollm2`` (the embedded SmolLM2-135M-Instruct with its default 8-concept pack). Ratios
are tokens/s relative to ``off``, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import Server, median, model_settings, serve, table, write_results

MODES = ("off", "every", "few")


async def generate(service: Any, prompt: list[int], max_tokens: int, mode: str) -> tuple[float, int, int]:
    from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
    from prismgate.core.events import TokenEvent

    n = len(prompt)
    if mode == "every":
        ranges: tuple[PositionRange, ...] = (PositionRange(n, n + max_tokens),)
    elif mode == "few":
        step = max(1, max_tokens // 4)
        ranges = tuple(PositionRange(n + i, n + i + 1) for i in range(0, max_tokens, step))[:4]
    else:
        ranges = ()
    spec = GenerateSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, readout_ranges=ranges)
    first = None
    tokens = readouts = 0
    async for event in service.run(GenerateAction(append_tokens=tuple(prompt), spec=spec, origin="bench")):
        if isinstance(event, TokenEvent) and not event.is_prefill:
            tokens += 1
            readouts += event.readout is not None
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return (tokens - 1) / (end - first), tokens, readouts


async def measure(name: str, server: Server, args: argparse.Namespace) -> list[dict[str, Any]]:
    info = server.service.info()
    prompt = info.tokenizer.encode(
        "The history of the lighthouse begins with the first fires lit on hills above harbours"
    )
    await generate(server.service, prompt, 8, "every")  # warm-up
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    counts: dict[str, int] = {}
    for rep in range(args.reps):
        for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
            rate, _, readouts = await generate(server.service, prompt, args.max_tokens, mode)
            rates[mode].append(rate)
            counts[mode] = readouts
    base = median(rates["off"])
    manifest = info.readouts
    rows = [
        {
            "model": name,
            "pack": f"{len(manifest.layers)} layers x {len(manifest.concepts)} concepts" if manifest else "none",
            "readouts": mode,
            "readouts_per_answer": counts[mode],
            "tokens_per_s": median(rates[mode]),
            "ratio_to_off": median(rates[mode]) / base,
        }
        for mode in MODES
    ]
    print(table(rows, list(rows[0])), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (128; quick 48)")
    parser.add_argument("--reps", type=int, default=None, help="answers per mode (6; quick 3)")
    args = parser.parse_args(argv)
    args.max_tokens = args.max_tokens or (48 if args.quick else 128)
    args.reps = args.reps or (3 if args.quick else 6)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        try:
            config = model_settings(name)
        except ValueError as exc:
            parser.error(str(exc))
        with serve(config) as server:
            rows += asyncio.run_coroutine_threadsafe(measure(name, server, args), server.loop).result()
    path = write_results(
        "readouts", {"quick": args.quick, "max_tokens": args.max_tokens, "reps": args.reps, "rows": rows}
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
