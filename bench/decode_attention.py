"""A decode step's attention on CPU: SDPA as transformers calls it against prismgate's decode attention.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.decode_attention [--rounds 9]

SmolLM2-135M's shapes (9 query heads on 3 key heads, 64 dimensions), bfloat16, one query per
row: microseconds per call of ``F.scaled_dot_product_attention`` with ``enable_gqa`` (as
transformers calls it for a step without a mask: one row) and with the keys repeated per query
head and the padding mask (the layout this benchmark compared first), and of
:func:`prismgate.engines.hf.decode_attention.decode_attention` (SDPA with each key head's query
heads as one block of rows), for each batch size and number of keys; rounds rotate their order.
Prints medians, the spread, and each of the two other layouts over ours per round.

``--accuracy``: SmolLM2 in bfloat16, each of a few prompts' 40 greedy float32 tokens fed back
one decode step at a time (teacher forcing), its logits against the float32 model's at each
step, with SDPA and with decode attention: mean and largest absolute error, and the steps whose
top token agrees.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import default_model
from prismgate.engines.hf.decode_attention import decode_attention


def _time(call: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        call()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


ACCURACY_PROMPTS = (
    "What is the capital of France? Tell me about its history.",
    "Write a haiku about autumn leaves.",
    "Explain how a bicycle gear system works.",
    "def add(a, b): return a + b. What does this print for add(2, 3)?",
    "List the first ten prime numbers.",
)


def accuracy(steps: int = 40) -> None:
    """The ``--accuracy`` table (see the module docstring)."""
    from prismgate.engines.hf import decode_attention as module

    bf16, f32 = default_model("bfloat16").adapter, default_model("float32").adapter

    def logits(model: Any, ids: list[int], tokens: list[int], ours: bool) -> torch.Tensor:
        takes = module.takes
        module.takes = takes if ours else (lambda *_: False)  # type: ignore[assignment]
        try:
            cache, rows = model.new_cache(), []
            model.forward(ids, cache, 0, [], [], [len(ids) - 1])
            for step, token in enumerate(tokens):
                rows.append(model.forward([token], cache, len(ids) + step, [], [], [0])[-1].float())
            return torch.stack(rows)
        finally:
            module.takes = takes

    print("| prompt | SDPA mean, max error | decode attention mean, max error | top token agrees, SDPA / ours |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for prompt in ACCURACY_PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            encoded = bf16.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = list(encoded if isinstance(encoded, list) else encoded["input_ids"])
            cache, tokens = f32.new_cache(), []
            row = f32.forward(ids, cache, 0, [], [], [len(ids) - 1])[-1]
            for step in range(steps):
                tokens.append(int(row.argmax()))
                row = f32.forward(tokens[-1:], cache, len(ids) + step, [], [], [0])[-1]
            want = logits(f32, ids, tokens, ours=False)
            cells = []
            agree = []
            for ours in (False, True):
                got = logits(bf16, ids, tokens, ours)
                error = (got - want).abs()
                cells.append(f"{float(error.mean()):.4f}, {float(error.max()):.3f}")
                agree.append(str(int((got.argmax(-1) == want.argmax(-1)).sum())))
            print(f"| {prompt[:30]} | {cells[0]} | {cells[1]} | {' / '.join(agree)} of {steps} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=100, help="calls timed per round")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--keys", default="100,1000,3500")
    parser.add_argument("--accuracy", action="store_true", help="the model's logits against float32 instead")
    args = parser.parse_args(argv)
    if args.accuracy:
        accuracy()
        return 0
    print(f"torch threads {torch.get_num_threads()}\n")
    header = ("rows", "keys", "enable_gqa us", "keys repeated, masked us", "decode attention us")
    print("| " + " | ".join((*header, "enable_gqa / ours", "repeated / ours")) + " |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for keys in (int(k) for k in args.keys.split(",")):
            q = torch.randn(batch, 9, 1, 64).to(torch.bfloat16)
            k, v = (torch.randn(batch, 3, keys, 64).to(torch.bfloat16) for _ in range(2))
            seen = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
            seen[0, ..., : keys // 10] = False  # one row left-padded, as in a batched step
            kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
            contenders: dict[str, Callable[[], object]] = {
                "gqa": functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True),
                "repeated": functools.partial(F.scaled_dot_product_attention, q, kr, vr, attn_mask=seen),
                "ours": functools.partial(decode_attention, q, k, v, seen, None),
            }
            names = list(contenders)
            times: dict[str, list[float]] = {name: [] for name in names}
            for round_ in range(args.rounds):
                for name in names[round_ % 3 :] + names[: round_ % 3]:
                    times[name].append(_time(contenders[name], args.calls))
            cells = [f"{statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f})" for t in times.values()]
            ratios = []
            for name in ("gqa", "repeated"):
                per_round = [s / o for s, o in zip(times[name], times["ours"], strict=True)]
                ratios.append(f"{statistics.median(per_round):.2f} ({min(per_round):.2f}-{max(per_round):.2f})")
            print(f"| {batch} | {keys} | {' | '.join(cells)} | {' | '.join(ratios)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
