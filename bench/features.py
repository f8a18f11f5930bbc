"""What SAE features cost, in decode tokens/s: the top 32 features at one layer on every token, against none.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.features [--rounds 3] [--tokens 48]

The transformers engine in-process (no wire), the embedded SmolLM2-135M-Instruct with its
shipped SAE (layer 15, 4096 features), greedy, the same prompt for every request; batches of
1, 4 and 8 requests at once, with and without features, interleaved round by round; tokens/s
counted from the last request's first token to the end, median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCHES = (1, 4, 8)
LAYER, TOP_K = 15, 32


async def _one(engine: Any, prompt: list[int], tokens: int, features: bool, request_id: str) -> float:
    from prismgate.core.actions import GenerateSpec, PositionRange
    from prismgate.core.engine import EngineRequest
    from prismgate.core.events import TokenEvent
    from prismgate.core.features import FeatureSpec

    ranges = (PositionRange(len(prompt), len(prompt) + tokens),)
    spec = GenerateSpec(
        max_tokens=tokens,
        temperature=0.0,
        ignore_eos=True,
        features=FeatureSpec(top_k=TOP_K, layers=(LAYER,), ranges=ranges) if features else None,
    )
    first = None
    async for event in engine.generate(EngineRequest(request_id, tuple(prompt), spec)):
        if isinstance(event, TokenEvent) and not event.is_prefill:
            assert (event.features is not None) == features
            first = first or time.perf_counter()
    assert first is not None
    return first


async def run(rounds: int, tokens: int) -> dict[tuple[int, bool], float]:
    from prismgate.engines.hf import TransformersEngine
    from prismgate.engines.models import resolve_model
    from prismgate.engines.sae.auto import SHIPPED, sae_folders

    engine = TransformersEngine(resolve_model(None)[0], threads=2, saes=((sae_folders(SHIPPED)[0], None),))
    await engine.start()
    prompt = engine.info.tokenizer.encode("Tell me a long story about a cat who lives in Paris.")
    speeds: dict[tuple[int, bool], list[float]] = {}
    try:
        for r in range(rounds):
            for batch in BATCHES:
                for features in (False, True):
                    ids = [f"{r}-{batch}-{features}-{i}" for i in range(batch)]
                    firsts = await asyncio.gather(*[_one(engine, prompt, tokens, features, i) for i in ids])
                    elapsed = time.perf_counter() - max(firsts)
                    speeds.setdefault((batch, features), []).append(batch * (tokens - 1) / elapsed)
    finally:
        await engine.close()
    return {key: statistics.median(values) for key, values in speeds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    result = asyncio.run(run(args.rounds, args.tokens))
    for batch in BATCHES:
        off, on = result[(batch, False)], result[(batch, True)]
        print(f"batch {batch}: off {off:.1f} tok/s, top-{TOP_K} at layer {LAYER} {on:.1f} tok/s, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
