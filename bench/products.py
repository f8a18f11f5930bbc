"""A decode step's linear products alone, SmolLM2's shapes: torch's packed oneDNN ones, siblings
apart and fused, against vLLM's own (where vLLM is installed).

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m bench.products [--quick] [--rounds 9] [--rows 1,4,8]

Thirty layers of random bfloat16 weights at SmolLM2-135M's shapes (query, key, value, output,
gate, up, down) and its 49,152-row LM head, each layer's weights distinct, so that as in a real
step none is left in the cache when it is read again. Per step: every layer's products at
``--rows`` rows, then the head's. Arms: packed for torch's oneDNN product
(``torch.ops.mkldnn._linear_pointwise``, what :mod:`prismgate.engines.hf.packing` runs) with
every layer apart, and with query/key/value and gate/up fused; under ``.venv-vllm`` the same two
through vLLM's ``onednn_mm``. Rounds rotate the arms; prints ms per step, medians and spread, and
each arm over torch apart per round (results in ``products.json``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench.common import spread, write_results

LAYERS, HIDDEN, KV, INTERMEDIATE, VOCAB = 30, 576, 192, 1536, 49152
Product = Callable[[torch.Tensor], torch.Tensor]


def _weights(generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)

    layers = []
    for _ in range(LAYERS):
        q, k, v, o = w(HIDDEN, HIDDEN), w(KV, HIDDEN), w(KV, HIDDEN), w(HIDDEN, HIDDEN)
        gate, up, down = w(INTERMEDIATE, HIDDEN), w(INTERMEDIATE, HIDDEN), w(HIDDEN, INTERMEDIATE)
        layers.append(
            {"q": q, "k": k, "v": v, "o": o, "gate": gate, "up": up, "down": down}
            | {"qkv": torch.cat([q, k, v]), "gateup": torch.cat([gate, up])}
        )
    return layers


def _torch_product(weight: torch.Tensor) -> Product:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _vllm_product(weight: torch.Tensor) -> Product:
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(weight.t(), 32)
    return lambda x: ops.onednn_mm(handler, x, None)


def _step(
    make: Callable[[torch.Tensor], Product], layers: list[dict[str, torch.Tensor]], head: torch.Tensor, fused: bool
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    names = ("qkv", "o", "gateup") if fused else ("q", "k", "v", "o", "gate", "up")
    products = [([make(layer[n]) for n in names], make(layer["down"])) for layer in layers]
    head_product = make(head)

    def step(x: torch.Tensor, wide: torch.Tensor) -> None:
        for narrow, down in products:
            for product in narrow:
                product(x)
            down(wide)
        head_product(x)

    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2 steps")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="steps per arm per round")
    parser.add_argument("--rows", default="1,4,8", help="rows of every product (decode batch sizes)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 2
    generator = torch.Generator().manual_seed(0)
    layers, head = _weights(generator), (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05).to(torch.bfloat16)
    makers = {"torch": _torch_product}
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        print("vLLM is not installed here: torch's products only (run under .venv-vllm for vLLM's)")
    else:
        makers["vllm"] = _vllm_product
    arms = {
        f"{name} {kind}": _step(make, layers, head, kind == "fused")
        for name, make in makers.items()
        for kind in ("apart", "fused")
    }
    names = list(arms)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); ms per step over {LAYERS} layers and the head"
    )
    results: dict[str, dict[str, list[float]]] = {}
    print("| rows | " + " | ".join(names) + " | " + " | ".join(f"{n} / torch apart" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, generator=generator).to(torch.bfloat16)
        wide = torch.randn(rows, INTERMEDIATE, generator=generator).to(torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in names}
        with torch.inference_mode():
            for round_ in range(args.rounds):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        arms[name](x, wide)
                    times[name].append((time.perf_counter() - started) / args.steps * 1e3)
        results[str(rows)] = times
        cells = [spread(times[n], ".2f") for n in names]
        cells += [spread([a / b for a, b in zip(times[n], times[names[0]], strict=True)], ".2f") for n in names[1:]]
        print(f"| {rows} | " + " | ".join(cells) + " |")
    write_results("products", {"args": vars(args), "ms_per_step": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
