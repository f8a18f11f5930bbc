"""Paced prefill on the engine: a long prompt's chunks shrink and take turns while a stream decodes.

The pace's clock is replaced by a fake one that each pass advances by a set time per token, so
what a chunk "took" is set by the test and the chunk sizes do not depend on the machine's speed;
the order of the model's work is read from a log of every pass the stepper runs.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prismgate.core.actions import PositionRange
from prismgate.core.events import TokenEvent
from prismgate.engines.hf import TransformersEngine
from tests.engines.requests import chat, run
from tests.engines.test_determinism import fingerprint

pytestmark = pytest.mark.asyncio(loop_scope="module")

Log = list[tuple[tuple[int, ...], int, int]]  # (prompt, start, end) of each pass a request ran on its own


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(long_model_dir: Path, tiny_pack: Path) -> AsyncIterator[Any]:
    eng = TransformersEngine(
        long_model_dir,
        model_id="tiny-llama",
        concept_pack=tiny_pack,
        dtype="bfloat16",
        threads=1,
        prefill_chunk=512,
        max_batch=1,  # every decode step is a pass of its own, in the log
        device="cpu",  # also where there is a GPU: there the transformers engine refuses deterministic requests
    )
    await eng.start()
    assert eng.info.deterministic, eng.info.deterministic_off
    yield eng
    await eng.close()


def logged(engine: Any, per_token_s: float | Callable[[], float]) -> Log:
    """Record every pass the stepper runs from now on; by the pace's clock each lasts ``per_token_s`` a token
    (or what it returns, asked once a pass). No decode step rides in a chunk's pass (engines/hf/mixed_pass.py):
    each is a pass of its own, in the log."""
    scheduler = engine._scheduler
    stepper = scheduler.stepper
    log: Log = []
    feed = type(stepper).feed
    now = [0.0]

    def recording(job: Any, start: int, end: int, riders: Any = None) -> None:
        log.append((job.request.tokens, start, end))
        now[0] += (end - start) * (per_token_s() if callable(per_token_s) else per_token_s)
        feed(stepper, job, start, end)

    stepper.feed = recording
    scheduler.pace.clock = lambda: now[0]
    return log


def restore(engine: Any) -> None:
    scheduler = engine._scheduler
    del scheduler.stepper.feed
    scheduler.pace = type(scheduler.pace)(ceiling=512, target_s=0.2)


def long_prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(0, 250) for _ in range(n))


async def first_token_then(engine: Any, prompt: tuple[int, ...], started: asyncio.Event, **spec: Any) -> None:
    """Run a request, setting ``started`` at its first generated token."""
    from prismgate.core.actions import GenerateSpec
    from prismgate.core.engine import EngineRequest

    request = EngineRequest(request_id=str(id(started)), tokens=prompt, spec=GenerateSpec(**spec))
    async for event in engine.generate(request):
        if isinstance(event, TokenEvent) and not event.is_prefill:
            started.set()


async def test_a_long_prompt_prefills_in_small_chunks_between_a_streams_tokens_then_larger_ones_alone(
    engine: Any,
) -> None:
    log = logged(engine, 0.001)  # a millisecond a token: 192-token chunks while the stream waits, 480 alone
    try:
        stream = chat(engine, "hello there")
        long = long_prompt(1, 3000)
        decoding = asyncio.Event()
        streaming = asyncio.create_task(first_token_then(engine, stream, decoding, max_tokens=8, ignore_eos=True))
        await asyncio.wait_for(decoding.wait(), 60)
        await run(engine, long, max_tokens=1)
        await streaming
    finally:
        restore(engine)
    chunks = [(i, end - start) for i, (tokens, start, end) in enumerate(log) if tokens == long and start < len(long)]
    decodes = [i for i, (tokens, start, end) in enumerate(log) if tokens == stream and start >= len(stream)]
    last_decode = decodes[-1]
    contended = [size for i, size in chunks if i < last_decode]
    alone = [size for i, size in chunks if i > last_decode]
    assert contended and set(contended) == {192}, contended  # the target's worth while the stream decoded
    # grown back once alone, to 2.5 targets' worth, not to the ceiling (512): a newcomer waits for a
    # step under way (the last chunk is the remainder)
    assert alone[:-1] and set(alone[:-1]) == {480}, alone
    # between two chunks of the prompt, the stream decoded a token
    between = [sum(1 for d in decodes if a < d < b) for (a, _), (b, _) in itertools.pairwise(chunks)]
    assert all(n >= 1 for n in between[: len(contended) - 1]), between


async def test_a_newcomer_steps_ahead_of_a_long_prompts_chunk_and_decodes_in_the_same_round(engine: Any) -> None:
    """Its first step before the round's chunk of the long prompt (its first token waits for no chunk),
    its first decode step in that same round (its second token waits for no second chunk)."""
    log = logged(engine, 0.003)  # 160-token chunks alone, so the newcomer arrives between two; a round of both then
    scheduler = engine._scheduler
    rounds: list[int] = []  # where in the log each round began
    plan, loop, chunked = scheduler._paced, asyncio.get_running_loop(), asyncio.Event()

    def paced() -> Any:
        rounds.append(len(log))
        if log:  # the long prompt has run a chunk
            loop.call_soon_threadsafe(chunked.set)
        return plan()

    scheduler._paced = paced
    try:
        long = long_prompt(5, 3000)
        prefilling = asyncio.create_task(run(engine, long, max_tokens=1))
        await asyncio.wait_for(chunked.wait(), 60)
        newcomer = chat(engine, "hi")
        await run(engine, newcomer, max_tokens=2, ignore_eos=True)
        await prefilling
    finally:
        del scheduler._paced
        restore(engine)
    mine = [i for i, (tokens, _, _) in enumerate(log) if tokens == newcomer]
    theirs = [i for i, (tokens, _, _) in enumerate(log) if tokens == long]
    assert len(mine) == 2 and log[mine[1]][1] == len(newcomer), log  # its prompt whole, then one decode step
    assert theirs[0] < mine[0] < theirs[-1], (mine, theirs)  # it came while the long prompt prefilled
    start = max(r for r in rounds if r <= mine[0])
    end = min((r for r in rounds if r > mine[0]), default=len(log))
    assert mine[0] == start, log[start : mine[0] + 1]  # the first pass of its round
    assert mine[1] < end, (mine, start, end)  # its second token in the same round
    assert sum(1 for i in theirs if start <= i < end) == 1  # the long prompt's chunk ran in that round too


async def test_several_long_prompts_take_turns_so_a_stream_waits_for_one_chunk_a_round(engine: Any) -> None:
    log = logged(engine, 0.003)  # 64-token chunks while the stream waits
    try:
        stream = chat(engine, "hello again")
        prompts = [long_prompt(seed, 700) for seed in (2, 3, 4)]
        decoding = asyncio.Event()
        streaming = asyncio.create_task(first_token_then(engine, stream, decoding, max_tokens=40, ignore_eos=True))
        await asyncio.wait_for(decoding.wait(), 60)
        await asyncio.gather(*(run(engine, p, max_tokens=1) for p in prompts))
        await streaming
    finally:
        restore(engine)
    kinds = [-1 if tokens == stream else prompts.index(tokens) for tokens, start, end in log]
    decodes = [i for i, kind in enumerate(kinds) if kind == -1]
    rounds = [kinds[a + 1 : b] for a, b in itertools.pairwise(decodes)]
    assert max(len(r) for r in rounds) == 1, rounds  # one prompt's chunk between two of the stream's tokens
    served = [r[0] for r in rounds if r]
    everyone = max(served.index(p) for p in range(3))  # from here on all three are prefilling
    assert len(served) > everyone + 9, served  # the stream outlived many turns
    for i in range(max(0, everyone - 2), everyone + 9):
        assert len(set(served[i : i + 3])) == 3, served  # in turns


async def test_a_deterministic_request_keeps_its_bits_when_its_chunks_change_size_mid_prefill(engine: Any) -> None:
    prompt = long_prompt(5, 1400)
    n = len(prompt)
    spec = {
        "max_tokens": 6,
        "ignore_eos": True,
        "deterministic": True,
        "logprob_top_k": 3,
        "logprob_ranges": (PositionRange(1, n + 6),),
        "readout_ranges": (PositionRange(0, n + 6),),
    }
    rng = random.Random(7)
    jitter = [False]  # alone, full chunks; then 0.3 to 6 ms a token: 32 to 512 tokens a chunk
    log = logged(engine, lambda: rng.uniform(0.0003, 0.006) if jitter[0] else 0.0008)
    try:
        alone, _ = await run(engine, prompt, **spec)
        full = [end - start for tokens, start, end in log if tokens == prompt and start < n]
        log.clear()
        jitter[0] = True
        stream = chat(engine, "keep talking")
        decoding = asyncio.Event()
        streaming = asyncio.create_task(first_token_then(engine, stream, decoding, max_tokens=60, ignore_eos=True))
        await asyncio.wait_for(decoding.wait(), 60)
        contended, _ = await run(engine, prompt, **spec)
        await streaming
    finally:
        restore(engine)
    chunks = [end - start for tokens, start, end in log if tokens == prompt and start < n]
    assert set(full[1:-1]) == {512}, full  # the first may be the floor, which measures the cost
    assert len(set(chunks[:-1])) >= 3, chunks  # the chunk size changed mid-prefill, more than once
    assert len(contended) == len(alone) == n + 6
    assert fingerprint(contended) == fingerprint(alone)
