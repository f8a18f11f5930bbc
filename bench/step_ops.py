"""What prismgate's ops in vLLM's graph cost per decode step, timed alone on this CPU.

    .venv-vllm/bin/python -m bench.step_ops [--rows 1,4,8] [--reps 9] [--steps 2000]

The default model's shapes: SmolLM2-135M's 30 decoder layers of width 576, its shipped pack's
layers and concepts, :data:`~prismgate.engines.vllm.steer.MAX_ROUNDS` steering rounds. Each
decoder layer is replaced by one that returns its input, and :func:`~prismgate.engines.vllm.
capture.install` wraps them exactly as in vLLM's worker, so one forward of the stand-in model is
the ops prismgate adds to one step and nothing else. It is compiled with torch.compile
(Inductor), as vLLM compiles the model, so the layers' Python wrappers are traced away and what
is timed is the custom ops' calls and work (``--eager`` times them uncompiled, wrappers and all).
The same stand-in without the ops (``bare``) is timed beside them and subtracted. Per batch size
(rows: the decode tokens of a step), the median over ``--reps`` rounds of the mean over
``--steps`` forwards, in microseconds per step, with the lowest and highest round:

* ``off``: nobody wants readouts (``wanted`` = 0) and nobody steers: what every step pays;
* ``readouts``: every row wants readouts (the projection onto the pack's directions, every layer);
* ``steer 1``: one concept vector added at every steering layer, readouts off.

Only torch and the project are imported: the same numbers from ``.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from prismgate.engines.readouts.pack import ConceptPack
from prismgate.engines.vllm.capture import install
from prismgate.engines.vllm.steer import MAX_ROUNDS

PACK = Path(__file__).resolve().parents[1] / "engines" / "readouts" / "packs" / "smollm2-135m-instruct.safetensors"
LAYERS, WIDTH = 30, 576  # SmolLM2-135M


class PassThrough(torch.nn.Module):
    """A decoder layer that costs nothing: returns (hidden, residual) as vLLM's Llama layers do."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden, residual


class StandIn(torch.nn.Module):
    """``model.layers``, where :func:`~prismgate.engines.introspect.decoder_layers` finds them."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(PassThrough() for _ in range(LAYERS))
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the device the ops' buffers go to

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual)
        return hidden + residual


def time_step(model: Any, rows: int, steps: int) -> float:
    """Mean microseconds of one forward of ``rows`` rows."""
    hidden, residual = torch.randn(rows, WIDTH), torch.randn(rows, WIDTH)
    for _ in range(50):
        model(hidden, residual)
    start = time.perf_counter()
    for _ in range(steps):
        model(hidden, residual)
    return (time.perf_counter() - start) / steps * 1e6


def measure(rows_list: list[int], reps: int, steps: int, compiled: bool) -> dict[str, Any]:
    pack = ConceptPack.load(PACK)
    max_rows = max(rows_list)
    model, bare = StandIn(), StandIn()
    wanted = torch.zeros(1, dtype=torch.int64)
    _, steering = install(
        model, list(pack.directions), list(pack.layers), max_rows, steering_rounds=MAX_ROUNDS, wanted=wanted
    )
    run: dict[str, Any] = {"bare": bare, "ops": model}
    if compiled:  # one graph per batch size, as vLLM compiles per size
        run = {name: torch.compile(m, fullgraph=True, dynamic=False) for name, m in run.items()}

    def configure(mode: str, rows: int) -> None:
        wanted[0] = int(mode == "readouts")
        for buffers in steering:
            buffers.rounds.zero_()
            buffers.index.zero_()
            buffers.scale.zero_()
            if mode == "steer 1":
                buffers.rounds[0] = 1
                buffers.index[:rows, 0] = 1  # the pack's first concept
                buffers.scale[:rows, 0] = 4.0

    modes = ("bare", "off", "readouts", "steer 1")
    times: dict[tuple[int, str], list[float]] = {}
    for rep in range(reps):
        order = modes if rep % 2 == 0 else tuple(reversed(modes))
        for rows in rows_list:
            for mode in order:
                configure(mode, rows)
                target = run["bare"] if mode == "bare" else run["ops"]
                times.setdefault((rows, mode), []).append(time_step(target, rows, steps))
    return {
        "compiled": compiled,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "pack": {"layers": list(pack.layers), "concepts": len(pack.concepts)},
        "steering_layers": len(steering),
        "rows": [
            {
                "rows": rows,
                "mode": mode,
                "us_per_step": statistics.median(t),
                "lowest": min(t),
                "highest": max(t),
            }
            for (rows, mode), t in times.items()
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8", help="decode rows per step")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eager", action="store_true", help="time the ops uncompiled")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with torch.inference_mode():
        results = measure([int(r) for r in args.rows.split(",")], args.reps, args.steps, not args.eager)
    how = "compiled" if results["compiled"] else "eager"
    print(f"torch {results['torch']}, {results['threads']} thread, {how}; pack {results['pack']}")
    print("| rows | ops | us per step (lowest-highest) | less bare |\n|---|---|---|---|")
    bare = {row["rows"]: row["us_per_step"] for row in results["rows"] if row["mode"] == "bare"}
    for row in results["rows"]:
        extra = row["us_per_step"] - bare[row["rows"]]
        span = f"{row['lowest']:.1f}-{row['highest']:.1f}"
        print(f"| {row['rows']} | {row['mode']} | {row['us_per_step']:.1f} ({span}) | {extra:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
