"""Fair share between keys on a saturated pool (docs/keys.md), on the embedded SmolLM2 model.

Two keys with equal weights, ``a`` and ``b``, on one gateway whose pool runs ``--slots``
generations at once (``max_active`` = ``max_batch``), everything over the OpenAI SSE API:

1. **idle**: b sends short requests (``--short`` tokens) one after another on an idle
   server: its time to first token (TTFT).
2. **loaded**: a keeps ``--flood`` long generations (``--long`` tokens) in flight (running or
   queued: each worker sends its next one as soon as one ends) while b sends the same short
   requests one after another: b's TTFT, as a ratio to idle, and how long b's request
   waited beyond a's mean engine step.
3. **split**: a's flood as before and b's own flood of short requests, both keys backlogged,
   for ``--window`` seconds: the generated tokens each key received in the window (counted
   from each token's logprob entry, one per token), with the fair share and, as the
   baseline, with both clients on the same key (first come, first served between them).

Prints a table and writes ``bench/results/fair_share.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import median, serve, settings, table, write_results
from prismgate.keys import entry_toml

KEYS = {"a": "k-bench-a-0123456789abcdef", "b": "k-bench-b-0123456789abcdef"}


def body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
    }


async def stream(
    http: httpx.AsyncClient, key: str, max_tokens: int, stamps: list[float] | None = None
) -> tuple[float, int]:
    """One streamed generation: (seconds to its first token, tokens); each token's arrival time into ``stamps``."""
    t0 = time.perf_counter()
    first = float("nan")
    tokens = 0
    headers = {"authorization": f"Bearer {key}"}
    async with http.stream("POST", "/v1/chat/completions", json=body(max_tokens), headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"]
            entries = ((choice[0].get("logprobs") or {}).get("content") or []) if choice else []
            if entries and tokens == 0:
                first = time.perf_counter() - t0
            tokens += len(entries)
            if stamps is not None:
                stamps.extend([time.perf_counter()] * len(entries))
    return first, tokens


async def flood(http: httpx.AsyncClient, key: str, workers: int, max_tokens: int, stamps: list[float]) -> None:
    """``workers`` generations of ``key`` in flight until cancelled."""

    async def worker() -> None:
        while True:
            await stream(http, key, max_tokens, stamps)

    await asyncio.gather(*(worker() for _ in range(workers)))


async def short_ttfts(http: httpx.AsyncClient, key: str, n: int, max_tokens: int) -> list[float]:
    return [(await stream(http, key, max_tokens))[0] for _ in range(n)]


async def run(base: str, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=4 * args.flood + 8, max_keepalive_connections=4 * args.flood + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        await short_ttfts(http, KEYS["b"], 2, args.short)  # warm-up
        idle = await short_ttfts(http, KEYS["b"], args.probes, args.short)

        a_stamps: list[float] = []
        a_flood = asyncio.create_task(flood(http, KEYS["a"], args.flood, args.long, a_stamps))
        await asyncio.sleep(args.settle)
        loaded = await short_ttfts(http, KEYS["b"], args.probes, args.short)
        recent = [t for t in a_stamps if t > time.perf_counter() - 5]
        step_s = args.slots * 5 / len(recent) if recent else float("nan")  # a's tokens: slots per engine step
        a_flood.cancel()
        await asyncio.gather(a_flood, return_exceptions=True)

        split = {}
        for mode, b_key in (("fair", KEYS["b"]), ("one key (baseline)", KEYS["a"])):
            stamps: dict[str, list[float]] = {"a": [], "b": []}
            floods = [
                asyncio.create_task(flood(http, KEYS["a"], args.flood, args.long, stamps["a"])),
                asyncio.create_task(flood(http, b_key, args.flood, args.short, stamps["b"])),
            ]
            await asyncio.sleep(args.settle)
            start = time.perf_counter()
            await asyncio.sleep(args.window)
            end = time.perf_counter()
            for task in floods:
                task.cancel()
            await asyncio.gather(*floods, return_exceptions=True)
            got = {k: sum(1 for t in v if start <= t < end) for k, v in stamps.items()}
            split[mode] = {**got, "b/a": got["b"] / got["a"] if got["a"] else float("nan")}
    return {
        "idle_ttft_s": idle,
        "loaded_ttft_s": loaded,
        "ttft_ratio_median": median(loaded) / median(idle),
        "engine_step_s": step_s,
        "split": split,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8, help="max_active and max_batch of the pool")
    parser.add_argument("--flood", type=int, default=64, help="generations a key keeps in flight")
    parser.add_argument("--long", type=int, default=256, help="tokens of a's long generations")
    parser.add_argument("--short", type=int, default=8, help="tokens of b's short requests")
    parser.add_argument("--probes", type=int, default=8, help="short requests timed idle and loaded")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds a flood runs before measuring")
    parser.add_argument("--window", type=float, default=60.0, help="seconds the token split is counted over")
    parser.add_argument("--quick", action="store_true", help="a 20 s window and 5 probes")
    args = parser.parse_args()
    if args.quick:
        args.window, args.probes = 20.0, 5
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys.toml"
        keys.write_text("\n".join(entry_toml(name, key, {}) for name, key in KEYS.items()))
        config = settings(  # the embedded SmolLM2 and its pack
            keys_file=str(keys), max_active=args.slots, max_batch=args.slots, max_queued=4 * args.flood
        )
        with serve(config) as server:
            result = asyncio.run(run(server.http_url, args))
    rows = [
        {"measure": "b's TTFT idle, median s", "value": median(result["idle_ttft_s"])},
        {"measure": "b's TTFT with a's flood, median s", "value": median(result["loaded_ttft_s"])},
        {"measure": "ratio loaded / idle", "value": result["ttft_ratio_median"]},
        {"measure": "engine step (a's decode), s", "value": result["engine_step_s"]},
    ]
    for mode, got in result["split"].items():
        rows.append({"measure": f"{mode}: tokens a / b in {args.window:.0f} s", "value": f"{got['a']} / {got['b']}"})
        rows.append({"measure": f"{mode}: b / a", "value": got["b/a"]})
    print(table(rows, ["measure", "value"]))
    write_results("fair_share", {"args": vars(args), **result})


if __name__ == "__main__":
    main()
