"""Deterministic requests: 0 differing bits, whatever else runs on the engine.

One deterministic request is run alone on an idle engine; then the same request runs under
random mixes of what a shared server does to it: 0 to 7 neighbours of other lengths joining at
other times (steered or not, deterministic or not, sampled or greedy), other prefill chunk sizes
and batch caps, and other cache states (no session, a cold session, its own cached prefix, a
cache left by a non-deterministic turn, a timeline built turn by turn). Token ids, every logprob
and top-logprob entry, and every readout must be equal to the bit, in bf16 (the default dtype)
and in float32, for plain, steered, gated and seeded-sampling requests.

The kernels under test are the model's own matrix products and attention, the same code for
every model: most mixes run on the tests' tiny model in bf16 (a few in the fast tier, more in
the exhaustive one), and a sample on the real default model in both dtypes (exhaustive tier).
The tiny model has no float32 subject: its products are too small for MKL's float32 kernels to
be row-invariant from eight rows up, so the engine's start-up check refuses deterministic
requests on it, as it should.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
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

pytestmark = pytest.mark.asyncio(loop_scope="module")

GENERATED = 6
SMOLLM2_PACK = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"

NEIGHBOUR_TEXTS = [
    "Hi",
    "Write a haiku about autumn leaves.",
    "Explain in detail how a bicycle gear system works, and why cyclists change gears on hills.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Quelle est la capitale de l'Italie ?",
    "List the first ten prime numbers, separated by commas, and say which one is even.",
]


@dataclass(frozen=True)
class Subject:
    """A model, its dtype, how many mixes it gets, and steering that names its layers and concepts."""

    model: str  # "tiny" (the tests' model and its random pack) or "smollm2" (the default model and pack)
    dtype: str
    mixes: int
    steer: SteeringEntry  # a plain steering entry on the target
    gated: SteeringEntry  # one behind a gate on another concept's readout
    neighbour_layers: tuple[int, ...]
    neighbour_concept: str


def tiny(dtype: str, mixes: int) -> Subject:
    gate = Gate(concept="concept1", layer=0, comparison=Comparison.BELOW, threshold=0)
    return Subject(
        "tiny",
        dtype,
        mixes,
        steer=SteeringEntry(layer=1, scale=6.0, concept="concept0"),
        gated=SteeringEntry(layer=1, scale=8.0, concept="concept2", gate=gate),
        neighbour_layers=(0, 1),
        neighbour_concept="concept2",
    )


def smollm2(dtype: str, mixes: int) -> Subject:
    gate = Gate(concept="question", layer=12, comparison=Comparison.BELOW, threshold=0)
    return Subject(
        "smollm2",
        dtype,
        mixes,
        steer=SteeringEntry(layer=12, scale=6.0, concept="french"),
        gated=SteeringEntry(layer=16, scale=8.0, concept="code", gate=gate),
        neighbour_layers=(8, 12, 16),
        neighbour_concept="formality",
    )


SUBJECTS = [
    pytest.param(tiny("bfloat16", 24), id="tiny-bf16"),
    pytest.param(tiny("bfloat16", 80), id="tiny-bf16-exhaustive", marks=pytest.mark.slow),
    pytest.param(smollm2("bfloat16", 10), id="smollm2-bf16", marks=pytest.mark.slow),
    pytest.param(smollm2("float32", 6), id="smollm2-f32", marks=pytest.mark.slow),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SUBJECTS)
async def subject(request: pytest.FixtureRequest, tiny_model_dir: Path, tiny_pack: Path) -> AsyncIterator[Any]:
    """(engine, subject): the engine started on the subject's model, in its dtype."""
    s: Subject = request.param
    if s.model == "tiny":
        model, model_id, pack = tiny_model_dir, "tiny-llama", tiny_pack
    else:
        model, model_id, pack = (
            default_model_path(),
            DEFAULT_MODEL_ID,
            DEFAULT_PACKS / "smollm2-135m-instruct.safetensors",
        )
    # on the CPU also where there is a GPU: there the transformers engine refuses deterministic requests
    engine = TransformersEngine(model, model_id=model_id, concept_pack=pack, threads=1, dtype=s.dtype, device="cpu")
    await engine.start()
    assert engine.info.deterministic, engine.info.deterministic_off
    yield engine, s
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


STATES = ["turn by turn", "left by a default turn", "own prefix", "cold session", "no session"]


def cases(s: Subject) -> dict[str, dict[str, Any]]:
    return {
        "greedy": {},
        "steered": {"steering": (s.steer,)},
        "gated": {"steering": (s.gated,)},
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


async def neighbour(engine: Any, s: Subject, rng: random.Random) -> None:
    await asyncio.sleep(rng.random() * 0.08)  # joins mid-way, at a random step
    prompt = chat(engine, rng.choice(NEIGHBOUR_TEXTS))
    n = len(prompt)
    spec: dict[str, Any] = {"max_tokens": rng.randint(1, 12), "ignore_eos": True}
    if rng.random() < 0.4:
        spec["steering"] = (
            SteeringEntry(layer=rng.choice(s.neighbour_layers), scale=rng.uniform(-8, 8), concept=s.neighbour_concept),
        )
    if rng.random() < 0.5:
        spec["deterministic"] = True
    if rng.random() < 0.5:
        spec.update(temperature=1.0, seed=rng.randrange(1000))
    if rng.random() < 0.5:
        spec.update(readout_ranges=(PositionRange(0, n + 12),), logprob_ranges=(PositionRange(1, n + 12),))
    await run(engine, prompt, session=uuid.uuid4().hex if rng.random() < 0.5 else None, **spec)


@pytest.mark.timeout(1800)  # on the real model: minutes on a loaded 2-core machine
async def test_deterministic_requests_give_the_same_bits_under_random_mixes(subject: Any) -> None:
    engine, s = subject
    by_case = cases(s)
    scheduler = engine._scheduler
    question = "What is the capital of France? Answer in one sentence."
    first = chat(engine, question)
    # the second turn of a conversation: the first turn's own answer, then a new message
    answer, _ = await run(engine, first, max_tokens=GENERATED, ignore_eos=True, deterministic=True)
    history = first + tuple(e.id for e in answer)
    second = history + chat(engine, "And of Spain?")[-12:]

    prompts = {"first": first, "second": second}
    alone = {}
    for case, extra in by_case.items():
        for which, prompt in prompts.items():
            events, done = await run(engine, prompt, **target_spec(prompt, **extra))
            assert done.completion_tokens == GENERATED
            alone[case, which] = fingerprint(events)
            if "temperature" not in extra:  # greedy: the token is the first entry of its own top-logprobs
                decoded = [e for e in events if not e.is_prefill]
                assert all(e.id == e.top_logprobs[0][0] for e in decoded)

    rng = random.Random(20261124 + s.mixes)  # the exhaustive tier's mixes are others than the fast tier's
    chunk, batch = scheduler.stepper.prefill_chunk, scheduler.max_batch
    conditions: list[str] = []
    try:
        for mix in range(s.mixes):
            case = rng.choice(list(by_case))
            scheduler.stepper.prefill_chunk = rng.choice([3, 7, 16, 64, 512])
            scheduler.max_batch = rng.choice([2, 4, 8, 16])
            if mix < len(STATES) * len(prompts):  # every cache state with both prompts first, then at random
                state, which = STATES[mix // len(prompts)], list(prompts)[mix % len(prompts)]
            else:
                state, which = rng.choice(STATES), rng.choice(list(prompts))
            prompt = prompts[which]
            key = None if state == "no session" else uuid.uuid4().hex
            if state == "own prefix":
                await run(engine, prompt, session=key, max_tokens=0, deterministic=True)
            elif state == "left by a default turn":
                await run(engine, prompt, session=key, max_tokens=2, ignore_eos=True)
            elif state == "turn by turn" and which == "second":
                await run(engine, first, session=key, max_tokens=GENERATED, ignore_eos=True, deterministic=True)
            neighbours = rng.randint(0, 7)
            results = await asyncio.gather(
                run(engine, prompt, session=key, **target_spec(prompt, **by_case[case])),
                *(neighbour(engine, s, rng) for _ in range(neighbours)),
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
    assert engine.stats["batched_steps"] > 0  # the neighbours did share forward passes with the target
    assert any("turn by turn" in c and "second" in c for c in conditions)


async def test_a_gate_that_never_opens_is_bit_for_bit_unsteered(subject: Any) -> None:
    """In default mode too (alone on the engine: in default mode a neighbour changes the bits)."""
    engine, s = subject
    for _ in range(600):  # requests a failed test left behind finish within seconds
        if not engine.in_flight():
            break
        await asyncio.sleep(0.05)
    prompt = chat(engine, "Tell me about the sea.")
    spec = target_spec(prompt, deterministic=False)
    never = SteeringEntry(
        layer=s.gated.layer,
        scale=12.0,
        concept=s.gated.concept,
        gate=Gate(s.gated.gate.concept, s.gated.gate.layer, Comparison.ABOVE, threshold=1e30),
    )
    plain, _ = await run(engine, prompt, **spec)
    gated, _ = await run(engine, prompt, **{**spec, "steering": (never,)})
    assert fingerprint(gated) == fingerprint(plain)
