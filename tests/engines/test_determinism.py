"""Deterministic requests on the real embedded model: 0 differing bits, whatever else runs (slow).

One deterministic request is run alone on an idle engine; then the same request runs under
random mixes of what a shared server does to it: 0 to 7 neighbours of other lengths joining at
other times (steered or not, deterministic or not, sampled or greedy), other prefill chunk sizes
and batch caps, and other cache states (no session, a cold session, its own cached prefix, a
cache left by a non-deterministic turn, a timeline built turn by turn). Token ids, every logprob
and top-logprob entry, and every readout must be equal to the bit, in bf16 (the default dtype)
and in float32, for plain, steered, gated and seeded-sampling requests.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from prismgate.core.actions import PositionRange
from prismgate.core.steering import Comparison, Gate, SteeringEntry
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
from prismgate.engines.readouts.pack import DEFAULT_PACKS
from tests.engines.requests import chat, run

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PACK = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"
MIXES = 50  # per dtype: 100 mixes in all
GENERATED = 6

NEIGHBOUR_TEXTS = [
    "Hi",
    "Write a haiku about autumn leaves.",
    "Explain in detail how a bicycle gear system works, and why cyclists change gears on hills.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Quelle est la capitale de l'Italie ?",
    "List the first ten prime numbers, separated by commas, and say which one is even.",
]
FRENCH = SteeringEntry(layer=12, scale=6.0, concept="french")
GATED = SteeringEntry(
    layer=16,
    scale=8.0,
    concept="code",
    gate=Gate(concept="question", layer=12, comparison=Comparison.BELOW, threshold=0),
)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["bfloat16", "float32"])
async def smol(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    engine = TransformersEngine(
        default_model_path(), model_id=DEFAULT_MODEL_ID, concept_pack=PACK, threads=1, dtype=request.param
    )
    await engine.start()
    assert engine.info.deterministic, engine.info.deterministic_off
    yield engine
    await engine.close()


def target_spec(prompt: tuple[int, ...], **extra: Any) -> dict[str, Any]:
    n = len(prompt)
    return {
        "max_tokens": GENERATED,
        "ignore_eos": True,
        "deterministic": True,
        "logprob_top_k": 5,
        "logprob_ranges": (PositionRange(n - 3, n + GENERATED),),
        "readout_ranges": (PositionRange(n - 3, n + GENERATED),),
        **extra,
    }


CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "steered": {"steering": (FRENCH,)},
    "gated": {"steering": (GATED,)},
    "sampled": {"temperature": 0.9, "top_p": 0.95, "seed": 1234},
}


def fingerprint(events: list[Any]) -> list[tuple[Any, ...]]:
    """Everything a client reads of each position, readouts as their exact bytes."""
    return [
        (
            e.id,
            e.position,
            e.logprob,
            tuple(e.top_logprobs or ()),
            None if e.readout is None else np.asarray(e.readout, dtype=np.float32).tobytes(),
        )
        for e in events
    ]


async def neighbour(engine: Any, rng: random.Random) -> None:
    await asyncio.sleep(rng.random() * 0.08)  # joins mid-way, at a random step
    prompt = chat(engine, rng.choice(NEIGHBOUR_TEXTS))
    n = len(prompt)
    spec: dict[str, Any] = {"max_tokens": rng.randint(1, 12), "ignore_eos": True}
    if rng.random() < 0.4:
        spec["steering"] = (
            SteeringEntry(layer=rng.choice([8, 12, 16]), scale=rng.uniform(-8, 8), concept="formality"),
        )
    if rng.random() < 0.5:
        spec["deterministic"] = True
    if rng.random() < 0.5:
        spec.update(temperature=1.0, seed=rng.randrange(1000))
    if rng.random() < 0.5:
        spec.update(readout_ranges=(PositionRange(0, n + 12),), logprob_ranges=(PositionRange(1, n + 12),))
    await run(engine, prompt, session=uuid.uuid4().hex if rng.random() < 0.5 else None, **spec)


@pytest.mark.timeout(1800)  # 50 mixes of up to 8 requests on the real model: minutes on a loaded 2-core machine
async def test_deterministic_requests_give_the_same_bits_under_100_random_mixes(smol: Any) -> None:
    scheduler = smol._scheduler
    question = "What is the capital of France? Answer in one sentence."
    first = chat(smol, question)
    # the second turn of a conversation: the first turn's own answer, then a new message
    answer, _ = await run(smol, first, max_tokens=GENERATED, ignore_eos=True, deterministic=True)
    history = first + tuple(e.id for e in answer)
    second = history + chat(smol, "And of Spain?")[-12:]

    prompts = {"first": first, "second": second}
    alone = {}
    for case, extra in CASES.items():
        for which, prompt in prompts.items():
            events, done = await run(smol, prompt, **target_spec(prompt, **extra))
            assert done.completion_tokens == GENERATED
            alone[case, which] = fingerprint(events)
            if "temperature" not in extra:  # greedy: the token is the first entry of its own top-logprobs
                decoded = [e for e in events if not e.is_prefill]
                assert all(e.id == e.top_logprobs[0][0] for e in decoded)

    rng = random.Random(20261124)
    chunk, batch = scheduler.stepper.prefill_chunk, scheduler.max_batch
    conditions: list[str] = []
    try:
        for mix in range(MIXES):
            case = rng.choice(list(CASES))
            which = rng.choice(list(prompts))
            prompt = prompts[which]
            scheduler.stepper.prefill_chunk = rng.choice([3, 7, 16, 64, 512])
            scheduler.max_batch = rng.choice([2, 4, 8, 16])
            state = rng.choice(["no session", "cold session", "own prefix", "left by a default turn", "turn by turn"])
            key = None if state == "no session" else uuid.uuid4().hex
            if state == "own prefix":
                await run(smol, prompt, session=key, max_tokens=0, deterministic=True)
            elif state == "left by a default turn":
                await run(smol, prompt, session=key, max_tokens=2, ignore_eos=True)
            elif state == "turn by turn" and which == "second":
                await run(smol, first, session=key, max_tokens=GENERATED, ignore_eos=True, deterministic=True)
            neighbours = rng.randint(0, 7)
            results = await asyncio.gather(
                run(smol, prompt, session=key, **target_spec(prompt, **CASES[case])),
                *(neighbour(smol, rng) for _ in range(neighbours)),
            )
            events, _ = results[0]
            described = (
                f"mix {mix}: {case} {which}, {state}, {neighbours} neighbours, "
                f"chunk {scheduler.stepper.prefill_chunk}, max_batch {scheduler.max_batch}"
            )
            conditions.append(described)
            assert fingerprint(events) == alone[case, which], described
    finally:
        scheduler.stepper.prefill_chunk, scheduler.max_batch = chunk, batch
    assert smol.stats["batched_steps"] > 0  # the neighbours did share forward passes with the target
    assert any("turn by turn" in c and "second" in c for c in conditions)


async def test_a_gate_that_never_opens_is_bit_for_bit_unsteered(smol: Any) -> None:
    """In default mode too (alone on the engine: in default mode a neighbour changes the bits)."""
    for _ in range(600):  # requests a failed test left behind finish within seconds
        if not smol.in_flight():
            break
        await asyncio.sleep(0.05)
    prompt = chat(smol, "Tell me about the sea.")
    spec = target_spec(prompt, deterministic=False)
    never = SteeringEntry(
        layer=16, scale=12.0, concept="code", gate=Gate("question", 12, Comparison.ABOVE, threshold=1e30)
    )
    plain, _ = await run(smol, prompt, **spec)
    gated, _ = await run(smol, prompt, **{**spec, "steering": (never,)})
    assert fingerprint(gated) == fingerprint(plain)
