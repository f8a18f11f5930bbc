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

Each is run with ``--reserved`` slots kept for keys with nothing running (``reserved_slots``,
0 and 1 by default). a's generations vary from 1/2 to 3/2 of ``--long`` so that their ends
spread out. The pool's fair queue is traced: for each of b's requests that queued, how many
of a's were admitted before it (the fair share's promise: none).

Prints a table and writes ``bench/results/fair_share.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
    """``workers`` generations of ``key`` in flight until cancelled, of 1/2 to 3/2 ``max_tokens`` each (seeded), so
    that they do not all end at once."""

    async def worker(rng: random.Random) -> None:
        while True:
            await stream(http, key, rng.randint(max(1, max_tokens // 2), max_tokens * 3 // 2), stamps)

    await asyncio.gather(*(worker(random.Random(i)) for i in range(workers)))


async def short_ttfts(http: httpx.AsyncClient, key: str, n: int, max_tokens: int) -> list[float]:
    return [(await stream(http, key, max_tokens))[0] for _ in range(n)]


class Trace:
    """Every queue push and admission of the pool's fair queue, by key (the gateway runs in this process)."""

    def __init__(self, fair: Any) -> None:
        self.events: list[tuple[float, str, str]] = []  # (time, "push" or "pop", key)
        push, pop, started = fair.push, fair.pop, fair.started
        popping = [False]

        def traced_push(share: Any, priority: int, future: Any, order: int | None = None) -> None:
            self.events.append((time.perf_counter(), "push", share.key))
            push(share, priority, future, order)

        def traced_pop(newcomers_only: bool = False) -> Any:
            popping[0] = True
            try:
                return pop(newcomers_only)
            finally:
                popping[0] = False

        def traced_started(share: Any) -> None:  # the queue's pop marks the key it admits as started
            if popping[0]:
                self.events.append((time.perf_counter(), "pop", share.key))
            started(share)

        fair.push, fair.pop, fair.started = traced_push, traced_pop, traced_started

    def passed_b(self) -> list[int]:
        """For each queued request of b: how many of a's requests were admitted while it waited."""
        counts: list[int] = []
        waiting: int | None = None
        for _, kind, key in self.events:
            if key == "b" and kind == "push":
                waiting = 0
            elif key == "b" and kind == "pop" and waiting is not None:
                counts.append(waiting)
                waiting = None
            elif key == "a" and kind == "pop" and waiting is not None:
                waiting += 1
        return counts


async def run(server: Any, args: argparse.Namespace, reserved: int, baseline: bool = True) -> dict[str, Any]:
    """The three measurements on ``server``, whose pool keeps ``reserved`` slots; the one-key baseline
    of the split too, with no reserved slot, unless ``baseline`` is false."""
    trace = Trace(server.service.pool.admission.fair)
    limits = httpx.Limits(max_connections=4 * args.flood + 8, max_keepalive_connections=4 * args.flood + 8)
    async with httpx.AsyncClient(base_url=server.http_url, timeout=600, limits=limits) as http:
        await short_ttfts(http, KEYS["b"], 2, args.short)  # warm-up
        idle = await short_ttfts(http, KEYS["b"], args.probes, args.short)

        a_stamps: list[float] = []
        a_flood = asyncio.create_task(flood(http, KEYS["a"], args.flood, args.long, a_stamps))
        await asyncio.sleep(args.settle)
        trace.events.clear()
        pool = server.service.pool
        counts = (pool.admission.preemptions, pool.admission.recomputes)
        memory_waiting = pool.memory.waiting  # a's requests waiting for the budget when b starts
        loaded = await short_ttfts(http, KEYS["b"], args.probes, args.short)
        preempted = pool.admission.preemptions - counts[0], pool.admission.recomputes - counts[1]
        passed = trace.passed_b()
        recent = [t for t in a_stamps if t > time.perf_counter() - 5]
        step_s = (args.slots - reserved) * 5 / len(recent) if recent else float("nan")  # a's tokens per step
        a_flood.cancel()
        await asyncio.gather(a_flood, return_exceptions=True)

        split = {}
        modes = [("fair", KEYS["b"])] + ([("one key (baseline)", KEYS["a"])] if baseline and not reserved else [])
        for mode, b_key in modes:
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
        "reserved_slots": reserved,
        "idle_ttft_s": idle,
        "loaded_ttft_s": loaded,
        "ttft_ratio_median": median(loaded) / median(idle),
        "b_queued": len(passed),
        "a_admitted_while_b_waited": passed,
        "engine_step_s": step_s,
        "memory_budget_bytes": pool.memory.limit,
        "memory_waiting_at_b": memory_waiting,
        "b_preemptions": preempted[0],
        "b_preemptions_recomputed": preempted[1],
        "split": split,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=8, help="max_active and max_batch of the pool")
    parser.add_argument("--flood", type=int, default=64, help="generations a key keeps in flight")
    parser.add_argument("--long", type=int, default=128, help="mean tokens of a's long generations")
    parser.add_argument(
        "--reserved", type=lambda v: [int(x) for x in v.split(",")], default=[0, 1], help="reserved_slots to run"
    )
    parser.add_argument("--short", type=int, default=8, help="tokens of b's short requests")
    parser.add_argument("--probes", type=int, default=8, help="short requests timed idle and loaded")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds a flood runs before measuring")
    parser.add_argument("--window", type=float, default=60.0, help="seconds the token split is counted over")
    parser.add_argument(
        "--memory-budget-mib",
        type=int,
        default=0,
        help="memory_budget_bytes in MiB (0: the default, sized to the machine)",
    )
    parser.add_argument("--quick", action="store_true", help="a 30 s window and 5 probes")
    args = parser.parse_args()
    if args.quick:
        args.window, args.probes = 30.0, 5
    results = []
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys.toml"
        keys.write_text("\n".join(entry_toml(name, key, {}) for name, key in KEYS.items()))
        for reserved in args.reserved:
            config = settings(  # the embedded SmolLM2 and its pack
                keys_file=str(keys),
                max_active=args.slots,
                max_batch=args.slots,
                max_queued=4 * args.flood,
                reserved_slots=reserved,
                memory_budget_bytes=args.memory_budget_mib << 20,
            )
            with serve(config) as server:
                results.append(asyncio.run(run(server, args, reserved)))
    rows = []
    for result in results:
        rows += [
            {"reserved slots": result["reserved_slots"], "measure": m, "value": v}
            for m, v in (
                ("b's TTFT idle, median s", median(result["idle_ttft_s"])),
                ("b's TTFT with a's flood, median s", median(result["loaded_ttft_s"])),
                ("ratio loaded / idle", result["ttft_ratio_median"]),
                ("b's requests that queued", result["b_queued"]),
                ("a's requests admitted while b queued", sum(result["a_admitted_while_b_waited"])),
                ("engine step (a's decode), s", result["engine_step_s"]),
                ("memory budget, MiB", result["memory_budget_bytes"] >> 20),
                ("a's requests waiting for memory as b began", result["memory_waiting_at_b"]),
                (
                    "b's preemptions (of them, cache dropped)",
                    f"{result['b_preemptions']} ({result['b_preemptions_recomputed']})",
                ),
            )
        ]
        for mode, got in result["split"].items():
            rows.append(
                {
                    "reserved slots": result["reserved_slots"],
                    "measure": f"{mode}: tokens a / b in {args.window:.0f} s (b / a)",
                    "value": f"{got['a']} / {got['b']} ({got['b/a']:.3f})",
                }
            )
    print(table(rows, ["reserved slots", "measure", "value"]))
    write_results("fair_share", {"args": vars(args), "runs": results})


if __name__ == "__main__":
    main()
