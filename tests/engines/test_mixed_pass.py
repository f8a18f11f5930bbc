"""Decode rows riding in a prompt chunk's pass (engines/hf/mixed_pass.py): the bits of passes of their own.

The pass itself is compared bit for bit with the passes it replaces, for chunks first and after a
prefix and for one, two and three riders (merged with padding); the engine is then run with a
long prompt prefilled in chunks while short answers decode, riding on and off.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineRequest
from prismgate.core.events import TokenEvent
from prismgate.engines.hf import TransformersEngine, mixed_pass
from tests.engines.requests import run, until

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def started(long_model_dir: Path, tiny_pack: Path, prefill_chunk: int) -> Any:
    # bfloat16: its products are oneDNN's, whose rows keep their bits in passes of two rows or more; float32's
    # (MKL's) need not, and where the start-up check finds a difference riding is off
    eng = TransformersEngine(
        long_model_dir,
        model_id="tiny-llama",
        concept_pack=tiny_pack,
        dtype="bfloat16",
        threads=1,
        prefill_chunk=prefill_chunk,
        device="cpu",
    )
    await eng.start()
    return eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(long_model_dir: Path, tiny_pack: Path) -> Any:
    eng = await started(long_model_dir, tiny_pack, 8)
    yield eng
    await eng.close()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def wide(long_model_dir: Path, tiny_pack: Path) -> Any:
    """The same engine with room for several short prompts in one chunk's pass."""
    eng = await started(long_model_dir, tiny_pack, 64)
    yield eng
    await eng.close()


def tokens(engine: Any, text: str) -> list[int]:
    return list(engine.info.tokenizer.encode(text))


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("riders", [1, 2, 3])
async def test_a_chunk_carrying_decode_rows_gives_every_row_and_key_the_bits_of_their_own_passes(
    engine: Any, start: int, riders: int
) -> None:
    adapter = engine._adapter
    texts = ["a b c", "a much longer line of text, so the merge pads", "mid length text"][:riders]
    with torch.inference_mode():
        prompt = tokens(engine, "the long prompt whose chunk carries them")
        differs = mixed_pass._differs(adapter, [(prompt, start)], [tokens(engine, t) for t in texts])
    assert differs == ""


async def test_the_start_up_check_turns_riding_off_and_says_why(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = engine._adapter
    assert engine._scheduler.stepper.rides  # the check passed at load
    assert mixed_pass.check(adapter, attention_installed=True).enabled
    off = mixed_pass.check(adapter, attention_installed=False)
    assert not off.enabled and "attention is not installed" in off.reason

    real = mixed_pass.attention

    def skewed(*args: Any, **kw: Any) -> Any:  # a chunk that attends slightly wrong
        out, weights = real(*args, **kw)
        return out * 1.05, weights

    monkeypatch.setattr(mixed_pass, "attention", skewed)
    failed = mixed_pass.check(adapter, attention_installed=True)
    assert not failed.enabled and "start-up check failed (the chunk's logits)" in failed.reason


async def answers(
    engine: Any, shorts: list[tuple[int, ...]], long: tuple[int, ...], errors: bool = False, **extra: Any
) -> list[Any]:
    """The short prompts' answers, and the long prompt's, submitted once every short one decodes
    (``errors``: a failed request's error in its place)."""
    decoding = [asyncio.Event() for _ in shorts]

    async def short(prompt: tuple[int, ...], started: asyncio.Event) -> Any:
        n = len(prompt)
        spec = GenerateSpec(
            max_tokens=24, ignore_eos=True, logprob_top_k=3, logprob_ranges=(PositionRange(n, n + 24),), **extra
        )
        events: list[TokenEvent] = []
        try:
            async for event in engine.generate(EngineRequest(request_id=f"s{n}", tokens=prompt, spec=spec)):
                if isinstance(event, TokenEvent):
                    events.append(event)
                    started.set()
        finally:
            started.set()  # one that failed does not hold the long prompt back
        return events

    async def long_one() -> Any:
        await asyncio.gather(*(e.wait() for e in decoding))
        events, _ = await run(engine, long, max_tokens=4, ignore_eos=True)
        return events

    return await asyncio.gather(
        *(short(p, e) for p, e in zip(shorts, decoding, strict=True)), long_one(), return_exceptions=errors
    )


def prompts(engine: Any) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    shorts = [tuple(tokens(engine, t)) for t in ("one", "two words", "three short words")]
    return shorts, tuple(tokens(engine, "a long prompt, prefilled in chunks of eight tokens " * 6))


async def test_decode_steps_ride_in_a_long_prompts_chunks_and_answer_as_in_passes_of_their_own(engine: Any) -> None:
    stepper, stats = engine._scheduler.stepper, engine.stats
    shorts, long = prompts(engine)
    stepper.rides = False
    try:
        alone = await answers(engine, shorts, long)
    finally:
        stepper.rides = True
    assert stats["ridden_steps"] == 0
    rode = await answers(engine, shorts, long)
    assert stats["ridden_steps"] >= 3  # the long prompt's chunks carried the others' steps
    for a, b in zip(alone, rode, strict=True):
        assert [e.id for e in a] == [e.id for e in b]
        for x, y in zip(a, b, strict=True):
            if x.logprob is not None:
                assert abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


async def test_decode_steps_that_read_out_keep_passes_of_their_own(engine: Any) -> None:
    shorts, long = prompts(engine)
    before = engine.stats["ridden_steps"]
    await answers(engine, shorts, long, readout_ranges=(PositionRange(0, 10_000),))
    assert engine.stats["ridden_steps"] == before


async def test_a_failing_chunk_fails_the_requests_it_carried_and_the_engine_serves_on(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shorts, long = prompts(engine)
    expected = await answers(engine, shorts, long)
    real = mixed_pass._SplitCache.update
    failures = [1]

    def update(self: Any, keys: Any, values: Any, layer_idx: int, *args: Any, **kw: Any) -> Any:
        if layer_idx == 1 and failures:  # the riders' first layer is written already
            failures.pop()
            raise RuntimeError("planted failure")
        return real(self, keys, values, layer_idx, *args, **kw)

    monkeypatch.setattr(mixed_pass._SplitCache, "update", update)
    got = await answers(engine, shorts, long, errors=True)
    assert not failures  # the planted failure happened
    failed = [outcome for outcome in got if isinstance(outcome, BaseException)]
    # the chunk's own request and those it carried (their caches half-written), and only with the planted error
    assert len(failed) >= 2 and all("planted failure" in str(error) for error in failed)
    # one not carried goes on (one carried and not failed would meet its half-written cache: another error)
    assert all(len(outcome) == 24 for outcome in got[:-1] if not isinstance(outcome, BaseException))
    again = await answers(engine, shorts, long)
    assert [[e.id for e in a] for a in again] == [[e.id for e in a] for a in expected]  # the engine serves on


async def test_a_chunk_that_reads_out_carries_them_and_its_readouts_keep_their_bits(engine: Any) -> None:
    stepper, stats = engine._scheduler.stepper, engine.stats
    shorts, long = prompts(engine)

    async def long_readouts() -> list[Any]:
        decoding = asyncio.Event()

        async def short() -> None:
            async for event in engine.generate(
                EngineRequest(request_id="s", tokens=shorts[1], spec=GenerateSpec(max_tokens=24, ignore_eos=True))
            ):
                if isinstance(event, TokenEvent):
                    decoding.set()

        async def reading() -> list[Any]:
            await decoding.wait()
            events, _ = await run(engine, long, max_tokens=1, readout_ranges=(PositionRange(0, len(long)),))
            return [e.readout for e in events if e.is_prefill]

        return (await asyncio.gather(short(), reading()))[1]

    stepper.rides = False
    try:
        alone = await long_readouts()
    finally:
        stepper.rides = True
    before = stats["ridden_steps"]
    rode = await long_readouts()
    assert stats["ridden_steps"] > before
    assert len(alone) == len(rode) == len(long)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(alone, rode, strict=True))


def test_readyz_says_whether_decode_steps_ride_and_why(live_server: Any) -> None:
    import httpx

    riding = httpx.get(f"{live_server.http_url}/readyz", timeout=30).json()["mixed_passes"]
    if riding["enabled"]:
        assert riding["reason"].startswith("decode rows ride in prompt chunks' passes"), riding
    else:  # the tests' tiny model in float32: the check may find the rows' last bits differ
        assert riding["reason"].startswith("decode rows run in passes of their own: "), riding


@pytest.mark.parametrize("riders", [0, 1, 2])
async def test_prompt_chunks_sharing_a_pass_give_every_row_and_key_the_bits_of_their_own_passes(
    engine: Any, riders: int
) -> None:
    adapter = engine._adapter
    texts = ["a b c", "a much longer line of text, so the merge pads"][:riders]
    with torch.inference_mode():
        first = tokens(engine, "the long prompt whose chunk carries them")
        second = tokens(engine, "another prompt, the first chunk in its cache")
        third = tokens(engine, "and a third")
        prompts = [(first, 5), (second, 0), (third, 0)]
        differs = mixed_pass._differs(adapter, prompts, [tokens(engine, t) for t in texts])
    assert differs == ""


async def test_the_start_up_check_turns_mixed_passes_off_when_shared_chunks_differ(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = mixed_pass.attention

    def skewed(*args: Any, **kw: Any) -> Any:  # only a pass of several chunks attends slightly wrong
        out, weights = real(*args, **kw)
        parts = mixed_pass.PLAN.active
        return (out * 1.05 if parts is not None and len(parts.bounds) > 1 else out), weights

    monkeypatch.setattr(mixed_pass, "attention", skewed)
    failed = mixed_pass.check(engine._adapter, attention_installed=True)
    assert not failed.enabled and "start-up check failed (the chunk's logits)" in failed.reason


def newcomers(engine: Any) -> list[tuple[int, ...]]:
    return [tuple(tokens(engine, t)) for t in ("one", "two", "three words", "four")]


async def together(
    engine: Any, prompts: list[tuple[int, ...]], tokens: int = 6, **extra: Any
) -> list[list[TokenEvent]]:
    """The answers of ``prompts`` submitted at once, each scoring its answer's ``tokens`` tokens."""

    async def one(prompt: tuple[int, ...]) -> list[TokenEvent]:
        n = len(prompt)
        spec = {"logprob_top_k": 3, "logprob_ranges": (PositionRange(n, n + tokens),), **extra}
        events, _ = await run(engine, prompt, max_tokens=tokens, ignore_eos=True, **spec)
        return events

    return list(await asyncio.gather(*(one(p) for p in prompts)))


async def test_newcomers_prompts_share_a_pass_and_answer_as_in_passes_of_their_own(wide: Any) -> None:
    engine = wide
    stepper, stats = engine._scheduler.stepper, engine.stats
    prompts = newcomers(engine)
    assert sum(len(p) for p in prompts) <= stepper.prefill_chunk  # all fit in one pass
    stepper.rides = False
    try:
        before = stats["shared_prefills"]
        firsts, answers = await together(engine, prompts, 1), await together(engine, prompts)
        assert stats["shared_prefills"] == before
    finally:
        stepper.rides = True
    shared_firsts = await together(engine, prompts, 1)
    assert stats["shared_prefills"] > before  # prompts that came together ran in one pass
    # the first token comes from the prompt's pass: the same bits, shared or not
    assert [(e.id, e.logprob, e.top_logprobs) for a in firsts for e in a] == [
        (e.id, e.logprob, e.top_logprobs) for a in shared_firsts for e in a
    ]
    shared = await together(engine, prompts)
    assert stats["shared_prefills"] > before + 1
    # and the answers go on from caches that hold what passes of their own wrote (their decode steps
    # batch otherwise, so their later logprobs may differ in the last bits)
    assert [[e.id for e in a] for a in answers] == [[e.id for e in a] for a in shared]


async def test_prompts_that_read_out_or_score_themselves_keep_passes_of_their_own(wide: Any) -> None:
    engine = wide
    stats = engine.stats
    prompts = newcomers(engine)
    before = stats["shared_prefills"]
    await together(engine, prompts, readout_ranges=(PositionRange(0, 10_000),))
    await asyncio.gather(*(run(engine, p, max_tokens=1, logprob_ranges=(PositionRange(1, len(p)),)) for p in prompts))
    assert stats["shared_prefills"] == before


async def test_newcomers_begin_in_the_fair_shares_order_and_share_a_pass_only_within_a_rank(wide: Any) -> None:
    """Three newcomers arrive while a step is under way: one of a key holding two slots (rank 2), then
    two of keys holding none (rank 0). The two rank-0 prompts share a pass and give their first tokens
    before the rank-2 one, which arrived first: its prompt does not join theirs, nor go ahead of them."""
    import threading
    import uuid

    engine = wide
    scheduler, stepper, stats = engine._scheduler, engine._scheduler.stepper, engine.stats
    blocker = EngineRequest(uuid.uuid4().hex, tuple(tokens(engine, "a step under way")), GenerateSpec(max_tokens=1))
    under_way, go_on = threading.Event(), threading.Event()
    step = stepper.step

    def held_step(job: Any, *args: Any) -> None:
        if job.request is blocker and not go_on.is_set():
            under_way.set()
            go_on.wait(60)
        step(job, *args)

    shared: list[list[str]] = []
    step_together = stepper.step_together

    def logged_together(jobs: list[Any], *args: Any) -> None:
        shared.append([job.request.request_id for job in jobs])
        step_together(jobs, *args)

    firsts: list[str] = []

    async def first(request: EngineRequest) -> None:
        async for event in engine.generate(request):
            if isinstance(event, TokenEvent) and not event.is_prefill:
                firsts.append(request.request_id)
                return

    stepper.step, stepper.step_together = held_step, logged_together
    try:
        blocking = asyncio.create_task(first(blocker))
        await until(under_way.is_set)
        prompts = newcomers(engine)
        ranked = [
            EngineRequest(name, prompts[i], GenerateSpec(max_tokens=2, ignore_eos=True), rank=rank)
            for i, (name, rank) in enumerate((("later", 2.0), ("b1", 0.0), ("b2", 0.0)))
        ]
        before = stats["shared_prefills"]
        tasks = [asyncio.create_task(first(r)) for r in ranked]
        await until(lambda: len(scheduler._inbox) == len(ranked))
        go_on.set()
        await asyncio.wait_for(asyncio.gather(blocking, *tasks), 60)
    finally:
        go_on.set()
        del stepper.step, stepper.step_together
    assert firsts[1:] == ["b1", "b2", "later"], firsts
    assert shared == [["b1", "b2"]] and stats["shared_prefills"] == before + 1


@pytest.mark.parametrize("rank", [1.0, 0.0], ids=["same-rank", "ranked-below"])
async def test_a_newcomer_ranked_below_every_decoding_request_carries_none_of_their_steps(
    engine: Any, rank: float
) -> None:
    """Two requests of rank 1 decode; a newcomer's prompt chunk carries their steps if it ranks as they
    do, and none if it ranks below them all (its key is further below its share): they then take
    their own pass after it."""
    stepper = engine._scheduler.stepper
    carried: list[bool] = []
    step = stepper.step

    def logged_step(job: Any, chunk: Any = None, riders: Any = None) -> None:
        if job.request.request_id == "newcomer" and job.generated == 0:
            carried.append(riders is not None)
        step(job, chunk, riders)

    shorts, long = prompts(engine)
    decoding = [
        EngineRequest(f"d{i}", p, GenerateSpec(max_tokens=40, ignore_eos=True), rank=1.0)
        for i, p in enumerate(shorts[:2])
    ]
    newcomer = EngineRequest("newcomer", long, GenerateSpec(max_tokens=1), rank=rank)
    stepper.step = logged_step
    try:
        tasks = [asyncio.create_task(run_request(engine, r)) for r in decoding]
        await until(lambda: all(job.generated >= 2 for job in engine._scheduler._active if job.request in decoding))
        await run_request(engine, newcomer)
        await asyncio.gather(*tasks)
    finally:
        del stepper.step
    assert len(carried) >= 2  # the long prompt's chunks
    assert any(carried) if rank == 1.0 else not any(carried), carried


async def run_request(engine: Any, request: EngineRequest) -> None:
    async for _ in engine.generate(request):
        pass
