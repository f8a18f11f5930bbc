"""What SAE features cost, in decode tokens/s: the top 32 features on every token, against none.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.features [--engine transformers] [--layers 1] [--rounds 3]
    .venv-vllm/bin/python -m bench.features --engine vllm [--layers 4]

The engine in-process (no wire), the embedded SmolLM2-135M-Instruct, greedy, the same prompt for
every request; batches of 1, 4 and 8 requests at once, with and without features, interleaved
round by round; tokens/s counted from the last request's first token to the end, median over the
rounds. The rows go to bench/results/features.json (replacing that engine's rows at that many
layers on the same device: ``cpu`` or the GPU's name), which ``bench/report.py`` turns into
docs/benchmarks.md's section.

``--layers 1``: the shipped SAE (layer 15, TopK, 4096 features, k = 32). ``--layers 4``:
that one plus three SAEs of the same shape at layers 5, 10 and 20 with random weights in
SAELens's format, written to a temporary folder for the run only: a cost measurement needs the
shapes, not trained features. The transformers engine runs the model's own dtype on 2 threads;
the vLLM engine runs float32 (vLLM's CPU backend is slow in bf16 without AVX512-BF16) with its
default compilation, as its tests do, and one OpenMP thread (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCHES = (1, 4, 8)
SHIPPED_LAYER, TOP_K = 15, 32
EXTRA_LAYERS = (5, 10, 20)  # with --layers 4: random SAEs of the shipped one's shape here
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


async def _one(engine: Any, prompt: list[int], tokens: int, layers: tuple[int, ...] | None, request_id: str) -> float:
    from prismgate.core.actions import GenerateSpec, PositionRange
    from prismgate.core.engine import EngineRequest
    from prismgate.core.events import TokenEvent
    from prismgate.core.features import FeatureSpec

    ranges = (PositionRange(len(prompt), len(prompt) + tokens),)
    spec = GenerateSpec(
        max_tokens=tokens,
        temperature=0.0,
        ignore_eos=True,
        features=FeatureSpec(top_k=TOP_K, layers=layers, ranges=ranges) if layers else None,
    )
    first = None
    async for event in engine.generate(EngineRequest(request_id, tuple(prompt), spec)):
        if isinstance(event, TokenEvent) and not event.is_prefill:
            assert (event.features is not None) == bool(layers)
            first = first or time.perf_counter()
    assert first is not None
    return first


def random_sae(folder: Path, like: Path, layer: int, seed: int) -> Path:
    """An SAE of ``like``'s shape and config at ``layer``, random weights (for a cost measurement only)."""
    import torch
    from safetensors.torch import save_file

    from prismgate.engines.sae.files import CFG_FILE, WEIGHTS_FILE

    cfg = json.loads((like / CFG_FILE).read_text())
    d_in, d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
    gen = torch.Generator().manual_seed(seed)
    weights = {
        "W_enc": torch.randn(d_in, d_sae, generator=gen) / d_in**0.5,
        "b_enc": torch.zeros(d_sae),
        "W_dec": torch.randn(d_sae, d_in, generator=gen) / d_sae**0.5,
        "b_dec": torch.zeros(d_in),
    }
    cfg["metadata"] = {"hook_name": f"blocks.{layer}.hook_resid_post", "model_name": "random, for bench/features.py"}
    folder.mkdir(parents=True)
    save_file(weights, str(folder / WEIGHTS_FILE))
    (folder / CFG_FILE).write_text(json.dumps(cfg))
    return folder


def build_engine(name: str, saes: list[Path]) -> Any:
    from prismgate.engines.models import resolve_model

    model = resolve_model(None)[0]
    specs = tuple((folder, None) for folder in saes)
    if name == "vllm":
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
        from prismgate.engines.vllm import VLLMEngine

        return VLLMEngine(model, dtype="float32", kv_cache_gb=1, saes=specs)
    from prismgate.engines.hf import TransformersEngine

    return TransformersEngine(model, threads=2, saes=specs)


async def run(engine_name: str, n_layers: int, rounds: int, tokens: int) -> dict[tuple[int, bool], list[float]]:
    """Tokens/s of every round, by (batch, features on)."""
    from prismgate.instruments.sae.auto import SHIPPED, sae_folders

    shipped = sae_folders(SHIPPED)[0]
    with tempfile.TemporaryDirectory(prefix="prismgate-bench-saes-") as tmp:
        saes = [shipped]
        if n_layers == 4:
            saes += [random_sae(Path(tmp) / f"layer{x}", shipped, x, x) for x in EXTRA_LAYERS]
        engine = build_engine(engine_name, saes)
        await engine.start()
        layers = tuple(sorted([SHIPPED_LAYER, *EXTRA_LAYERS][:n_layers]))
        prompt = engine.info.tokenizer.encode("Tell me a long story about a cat who lives in Paris.")
        speeds: dict[tuple[int, bool], list[float]] = {}
        try:
            await _one(engine, prompt, 4, layers, "warm-up")  # vLLM compiles on its first shapes
            for r in range(rounds):
                for batch in BATCHES:
                    for features in (False, True) if r % 2 == 0 else (True, False):  # alternate which runs first
                        ids = [f"{r}-{batch}-{features}-{i}" for i in range(batch)]
                        asked = layers if features else None
                        firsts = await asyncio.gather(*[_one(engine, prompt, tokens, asked, i) for i in ids])
                        elapsed = time.perf_counter() - max(firsts)
                        speeds.setdefault((batch, features), []).append(batch * (tokens - 1) / elapsed)
        finally:
            await engine.close()
    return speeds


def save(
    engine: str,
    n_layers: int,
    rounds: int,
    tokens: int,
    speeds: dict[tuple[int, bool], list[float]],
    load: list[float] | None,
    note: str = "",
) -> Path:
    """Merge this run's rows into bench/results/features.json (other engines' and layer counts' rows stay)."""
    from bench.common import RESULTS, write_results

    old = RESULTS / "features.json"
    runs = json.loads(old.read_text()).get("runs", []) if old.exists() else []
    device = device_name()
    runs = [r for r in runs if (r["engine"], r["layers"], r.get("device", "cpu")) != (engine, n_layers, device)]
    rows = []
    for batch in BATCHES:
        off, on = speeds[(batch, False)], speeds[(batch, True)]
        paired = [b / a for a, b in zip(off, on, strict=True)]  # the two halves of one round, back to back
        rows.append(
            {
                "engine": engine,
                "device": device,
                "sae_layers": n_layers,
                "batch": batch,
                "off_tokens_per_s": statistics.median(off),
                "features_tokens_per_s": statistics.median(on),
                "ratio_to_off": statistics.median(on) / statistics.median(off),
                "round_ratio_median": statistics.median(paired),
                "round_ratio_range": [min(paired), max(paired)],
            }
        )
    runs.append(
        {
            **({"note": note} if note else {}),
            "engine": engine,
            "device": device,
            "layers": n_layers,
            "rounds": rounds,
            "tokens": tokens,
            "load_average": load,
            "rows": rows,
        }
    )
    runs.sort(key=lambda r: (r.get("device", "cpu") != "cpu", r["engine"], r["layers"]))
    return write_results("features", {"top_k": TOP_K, "runs": runs})


def device_name() -> str:
    """Where the engine ran: ``cpu``, or the GPU's name (the engines take the GPU when there is one)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def cpu_description() -> str:
    """The CPU a run's figures belong to: bf16 kernels differ by instruction set (AVX-512 or AVX2 only)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    isa = "AVX-512" if "avx512f" in info else "AVX2 without AVX-512" if "avx2" in info else "no AVX2"
    return f"{model}, {isa}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--layers", type=int, choices=(1, 4), default=1, help="SAE layers read on every token")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    before = os.getloadavg()[0]
    speeds = asyncio.run(run(args.engine, args.layers, args.rounds, args.tokens))
    note = cpu_description() if device_name() == "cpu" else ""
    path = save(args.engine, args.layers, args.rounds, args.tokens, speeds, [before, os.getloadavg()[0]], note)
    where = f"layer {SHIPPED_LAYER}" if args.layers == 1 else f"{args.layers} layers"
    key = (args.engine, args.layers, device_name())
    print(f"engine {args.engine}, top-{TOP_K} features at {where}")
    run_ = next(r for r in json.loads(path.read_text())["runs"] if (r["engine"], r["layers"], r["device"]) == key)
    for row in run_["rows"]:
        (low, high), mid = row["round_ratio_range"], row["round_ratio_median"]
        print(
            f"batch {row['batch']}: off {row['off_tokens_per_s']:.1f} tok/s, "
            f"features {row['features_tokens_per_s']:.1f} tok/s, ratio {row['ratio_to_off']:.3f} "
            f"(round by round {mid:.3f}, {low:.3f}-{high:.3f})"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
