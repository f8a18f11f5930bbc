"""A newcomer key's first token under a flood, under the transformers engine's newcomer rules.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.newcomers [--rounds 3] [--window 30] [--probes 24]

``bench.fair_share``'s measurements (reserved_slots 0, its defaults otherwise: SmolLM2 and its
pack, 8 slots, key a's flood of 64 long generations, key b's short requests; but 24 probes a run,
since b's wait depends on where in a's round it arrives), under three rules rotating round by
round, a fresh server a run:

* ``as it runs``: a round's newcomers begin in the fair share's order (``EngineRequest.rank``), and
  one that arrives during a round cuts in at its next pass (``Scheduler._cut_in``);
* ``no cut-in``: the same order, but a newcomer waits for the round under way to end;
* ``before``: neither, the rule before them: newcomers first come, first served, at the round's end.

Per rule, medians over rounds with their spread: b's time to first token idle and under a's flood,
their ratio (the issue's goal: 2x idle at most), the split of generated tokens with both keys
backlogged (b / a) and the tokens both keys got in the window (what the rules cost in throughput).

Results in ``newcomers.json``; not in ``make bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import fair_share
from bench.common import serve, settings, spread, table, write_results
from prismgate.keys import entry_toml

RULES = ("as it runs", "no cut-in", "before")


def _apply(server: Any, rule: str) -> None:
    """Puts the server's pool and engine scheduler under ``rule`` (see the module docstring)."""
    pool = server.service.pool
    if rule in ("no cut-in", "before"):
        pool.engine()._scheduler._cut_in = lambda pending, carry=None: (False, False)
    if rule == "before":
        pool.admission.rank = lambda share: 0.0


def _row(result: dict[str, Any], window: float) -> dict[str, float]:
    split = result["split"]["fair"]
    return {
        "idle_ttft_s": statistics.median(result["idle_ttft_s"]),
        "loaded_ttft_s": statistics.median(result["loaded_ttft_s"]),
        "ratio": result["ttft_ratio_median"],
        "b/a": split["b/a"],
        "tokens_per_s": (split["a"] + split["b"]) / window,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running every rule once")
    parser.add_argument("--window", type=float, default=30.0, help="seconds the token split is counted over")
    parser.add_argument("--probes", type=int, default=24, help="b's short requests timed idle and loaded, a run")
    args = parser.parse_args()
    measure = argparse.Namespace(
        slots=8, flood=64, long=128, short=8, probes=args.probes, settle=5.0, window=args.window, memory_budget_mib=0
    )
    runs: dict[str, list[dict[str, float]]] = {rule: [] for rule in RULES}
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys.toml"
        keys.write_text("\n".join(entry_toml(name, key, {}) for name, key in fair_share.KEYS.items()))
        config = settings(keys_file=str(keys), max_active=8, max_batch=8, max_queued=4 * 64, reserved_slots=0)
        for round_ in range(args.rounds):
            for rule in RULES[round_ % len(RULES) :] + RULES[: round_ % len(RULES)]:
                with serve(config) as server:  # a fresh server a run: nothing left from the last one's floods
                    _apply(server, rule)
                    result = asyncio.run(fair_share.run(server, measure, 0, baseline=False))
                runs[rule].append(_row(result, args.window))
                print(round_, rule, {k: round(v, 3) for k, v in runs[rule][-1].items()}, flush=True)
    formats = {"idle_ttft_s": ".3f", "loaded_ttft_s": ".3f", "ratio": ".2f", "b/a": ".3f", "tokens_per_s": ".1f"}
    rows = [
        {"rule": rule, **{k: spread([r[k] for r in got], f) for k, f in formats.items()}} for rule, got in runs.items()
    ]
    print(table(rows, ["rule", "idle_ttft_s", "loaded_ttft_s", "ratio", "b/a", "tokens_per_s"]))
    write_results("newcomers", {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
