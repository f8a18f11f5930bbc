"""The transformers engine runs concurrent decode steps as one batch: same results as alone."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineRequest
from prismgate.core.events import TokenEvent
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.hf.batch_cache import BatchCache
from tests.engines.requests import run, until


@pytest_asyncio.fixture
async def engine(tiny_model_dir: Path, tiny_pack: Path) -> Any:
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, prefill_chunk=16)
    await eng.start()
    yield eng
    await eng.close()


def prompts(engine: Any) -> list[tuple[int, ...]]:
    # different lengths, so the batch pads caches of different sizes
    texts = ["a", "a longer question about prisms", "mid length", "the longest prompt of them all, by some margin"]
    return [tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": t}])) for t in texts]


async def test_batched_decode_equals_one_at_a_time(engine: Any) -> None:
    ps = prompts(engine)

    def spec(p: tuple[int, ...]) -> dict[str, Any]:
        n = len(p)
        return {
            "max_tokens": 24, "ignore_eos": True, "logprob_top_k": 3,
            "logprob_ranges": (PositionRange(n, n + 24),), "readout_ranges": (PositionRange(n - 2, n + 24),),
        }  # fmt: skip

    alone = [await run(engine, p, **spec(p)) for p in ps]
    assert engine.stats["batched_steps"] == 0
    together = await asyncio.gather(*(run(engine, p, **spec(p)) for p in ps))
    assert engine.stats["batched_steps"] > 10  # most decode steps ran batched
    for (a_events, a_done), (b_events, b_done) in zip(alone, together, strict=True):
        assert [e.id for e in a_events] == [e.id for e in b_events]
        assert [e.position for e in a_events] == [e.position for e in b_events]
        assert a_done.completion_tokens == b_done.completion_tokens == 24
        for a, b in zip(a_events, b_events, strict=True):
            if a.logprob is not None:
                assert abs(a.logprob - b.logprob) < 1e-4
                assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            assert np.allclose(a.readout, b.readout, atol=1e-4)


async def test_session_caches_stay_exact_after_batched_turns(engine: Any) -> None:
    ps = prompts(engine)
    keys = [uuid.uuid4().hex for _ in ps]
    first = await asyncio.gather(
        *(run(engine, p, key, max_tokens=16, ignore_eos=True) for p, key in zip(ps, keys, strict=True))
    )
    assert engine.stats["batched_steps"] > 0
    follow = [p + tuple(e.id for e in ev) + (65, 66, 67) for p, (ev, _) in zip(ps, first, strict=True)]
    cached = await asyncio.gather(
        *(run(engine, t, key, max_tokens=8, ignore_eos=True) for t, key in zip(follow, keys, strict=True))
    )
    for t, (events, done) in zip(follow, cached, strict=True):
        fresh, _ = await run(engine, t, max_tokens=8, ignore_eos=True)
        assert done.cached_tokens >= len(t) - 4  # the batched turn's cache was reused
        assert [e.id for e in events] == [e.id for e in fresh]


async def test_a_batch_of_one_is_not_batched(tiny_model_dir: Path) -> None:
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", threads=1, max_batch=1)
    await eng.start()
    try:
        p = tuple(eng.info.tokenizer.encode("hello"))
        await asyncio.gather(*(run(eng, p, max_tokens=8, ignore_eos=True) for _ in range(3)))
        assert eng.stats["batched_steps"] == 0
    finally:
        await eng.close()


async def test_a_newcomer_prefills_before_the_batched_decode_step(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker's rounds, recorded: "round" when it plans its prefill, "batch" for the batched
    # decode step, and each request's own steps. A request that arrives while others decode in a
    # batch takes its first step ahead of that round's batched step: its first token waits for
    # nobody else's next one.
    from prismgate.engines.hf import scheduler as scheduling

    log: list[str] = []
    real_decode = scheduling.decode_batch
    real_paced = engine._scheduler._paced

    def paced() -> Any:  # planned once at the start of every round
        log.append("round")
        return real_paced()

    batched = asyncio.Event()
    loop = asyncio.get_running_loop()

    def decode(stepper: Any, jobs: Any, ridden: Any = None) -> None:
        log.append("batch")
        real_decode(stepper, jobs, ridden)
        if log.count("batch") == 5:  # the three decode together
            loop.call_soon_threadsafe(batched.set)

    monkeypatch.setattr(engine._scheduler, "_paced", paced)
    monkeypatch.setattr(scheduling, "decode_batch", decode)
    stepper = engine._scheduler.stepper
    real_step = stepper.step
    monkeypatch.setattr(
        stepper,
        "step",
        lambda job, chunk=None, riders=None: (log.append(job.request.request_id), real_step(job, chunk, riders))[1],
    )

    ps = prompts(engine)
    running = [asyncio.create_task(run(engine, p, max_tokens=48, ignore_eos=True)) for p in ps[:3]]
    await asyncio.wait_for(batched.wait(), 60)
    request = EngineRequest(request_id="newcomer", tokens=ps[3], spec=GenerateSpec(max_tokens=4))
    async for _ in engine.generate(request):
        pass
    await asyncio.gather(*running)
    first = log.index("newcomer")
    its_round = max(i for i in range(first) if log[i] == "round")
    assert "batch" not in log[its_round:first], log[its_round - 2 : first + 3]
    assert "batch" in log[first:]  # the others' batched step still ran in that round


async def test_requests_ending_together_share_the_pass_of_their_last_token(engine: Any) -> None:
    # The last decoded token's readout comes from a pass that feeds it. Requests that end on the
    # same batched step get that pass together (one more batched pass), not one pass each: with
    # readouts on every token, four requests ending together once cost four single passes at the end.
    from prismgate.engines.introspect import decoder_layers

    passes: list[tuple[int, int]] = []  # (rows, tokens) of every forward pass, in order
    layer = decoder_layers(engine._scheduler.stepper.adapter.model)[0]
    handle = layer.register_forward_hook(
        lambda _m, _a, out: passes.append(tuple((out[0] if isinstance(out, tuple) else out).shape[:2]))
    )
    p = prompts(engine)[1]
    n, k = 12, 4
    spec = {"max_tokens": n, "ignore_eos": True, "readout_ranges": (PositionRange(len(p), len(p) + n),)}
    try:
        for _ in range(10):  # until the four start decoding on the same round (a loaded machine may stagger them)
            passes.clear()
            together = await asyncio.gather(*(run(engine, p, **spec) for _ in range(k)))
            batched = [rows for rows, _ in passes if rows > 1]
            if batched and set(batched) == {k}:
                break
        else:
            pytest.skip("the four requests never decoded in step (a machine too loaded to arrange it)")
    finally:
        handle.remove()
    for events, done in together:
        assert done.completion_tokens == n
        assert all(e.readout is not None for e in events)  # the last token's readout too
    last_batch = max(i for i, (rows, _) in enumerate(passes) if rows == k)
    assert passes[last_batch] == (k, 1)
    assert passes[last_batch + 1 :] == []  # no single pass of one request's last token after it
    alone, _ = await run(engine, p, **spec)
    for events, _ in together:
        assert [e.id for e in events] == [e.id for e in alone]
        for a, b in zip(alone, events, strict=True):
            assert np.allclose(a.readout, b.readout, atol=1e-4)


def test_a_request_joins_a_batch_only_while_its_padding_is_small() -> None:
    # Every member's cache is padded to the longest: a long request beside short ones would make
    # them hold its length each. It decodes on its own and the short ones batch together.
    from types import SimpleNamespace

    from prismgate.engines.hf.batched_decode import batch_members, padding_allowance

    def job(tokens: int) -> Any:
        return SimpleNamespace(cancelled=False, idle=False, decoding=True, timeline=[0] * (tokens + 1))

    long, shorts = job(3516), [job(n) for n in (40, 60, 200)]
    assert batch_members([long, *shorts], max_batch=8, max_batch_tokens=16384) == shorts
    assert batch_members([*shorts, long], max_batch=8, max_batch_tokens=16384) == shorts
    near = [job(3516), job(3000)]  # 516 positions of padding beside 6,516 tokens: within a quarter
    assert batch_members(near, max_batch=8, max_batch_tokens=16384) == near
    assert padding_allowance(6516, 16384) == 2048
    assert batch_members([long, shorts[0]], max_batch=8, max_batch_tokens=16384) == []  # 3,476 > 2,048


async def test_a_long_request_decodes_beside_short_ones_without_padding_them(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", threads=1, prefill_chunk=512, max_batch_tokens=2048)
    await eng.start()
    try:
        held: list[tuple[int, int]] = []  # (rows, width) of the merged cache after every batched step
        real_step = BatchCache.step

        def step(self: BatchCache, ids: Any, caches: Any, positions: Any) -> Any:
            out = real_step(self, ids, caches, positions)
            held.append((len(caches), self.width))
            return out

        monkeypatch.setattr(BatchCache, "step", step)
        long = tuple(eng.info.tokenizer.encode("prisms " * 60))[:300]
        short = tuple(eng.info.tokenizer.encode("hello"))
        results = await asyncio.gather(
            run(eng, long, max_tokens=24, ignore_eos=True),
            *(run(eng, short, max_tokens=24, ignore_eos=True) for _ in range(3)),
        )
        assert all(done.completion_tokens == 24 for _, done in results)
        assert held, "the short requests never decoded together"
        assert max(rows * width for rows, width in held) <= 256  # never a short one padded to the long one
        assert max(width for _, width in held) < len(long)
    finally:
        await eng.close()


def test_decode_steps_beyond_one_batch_form_further_batches() -> None:
    from types import SimpleNamespace

    from prismgate.engines.hf.batched_decode import batch_groups

    def job(tokens: int) -> Any:
        return SimpleNamespace(cancelled=False, idle=False, decoding=True, timeline=[0] * (tokens + 1))

    jobs = [job(40 + i) for i in range(7)]
    # batches of up to three, in order; the one left over takes the plain step
    assert batch_groups(jobs, max_batch=3, max_batch_tokens=16384) == [jobs[:3], jobs[3:6]]
    long = job(3516)  # too long to pad the others to: it steps alone, the short ones still batch
    assert batch_groups([long, *jobs[:4]], max_batch=2, max_batch_tokens=16384) == [jobs[:2], jobs[2:4]]
    assert batch_groups(jobs[:1], max_batch=3, max_batch_tokens=16384) == []


async def test_more_requests_than_a_batch_takes_decode_in_several_batches_and_answer_as_alone(
    tiny_model_dir: Path, tiny_pack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, max_batch=2)
    await eng.start()
    try:
        stepper = eng._scheduler.stepper
        alone_steps = [0]
        real_step = type(stepper).step

        def counted(self: Any, job: Any, chunk: Any = None, riders: Any = None) -> None:
            if job.decoding:
                alone_steps[0] += 1  # a decode step in a pass of its own
            real_step(self, job, chunk, riders)

        ps = prompts(eng)
        spec = {"max_tokens": 16, "ignore_eos": True}
        alone = [await run(eng, p, **spec) for p in ps]
        monkeypatch.setattr(type(stepper), "step", counted)
        passes: list[int] = []  # rows of each batched pass
        real_batch_step = BatchCache.step

        def batch_step(self: BatchCache, ids: Any, caches: Any, positions: Any) -> Any:
            passes.append(len(caches))
            return real_batch_step(self, ids, caches, positions)

        monkeypatch.setattr(BatchCache, "step", batch_step)
        together = await asyncio.gather(*(run(eng, p, **spec) for p in ps))
        assert len(stepper.batches.batches) >= 2  # two merges kept side by side
        assert set(passes) == {2} and len(passes) >= 16  # four requests: two batches of two a round
        assert alone_steps[0] <= 4  # a newcomer's first step at most, never a round of single passes
        for (a_events, _), (b_events, b_done) in zip(alone, together, strict=True):
            assert b_done.completion_tokens == 16
            assert [e.id for e in a_events] == [e.id for e in b_events]
    finally:
        await eng.close()


def test_a_request_that_ended_mid_round_is_not_decoding() -> None:
    from prismgate.engines.hf.bridge import EventChannel
    from prismgate.engines.hf.job import Job

    loop = asyncio.new_event_loop()
    try:
        request = EngineRequest(request_id="j", tokens=(1, 2), spec=GenerateSpec(max_tokens=4))
        job = Job(request, EventChannel(loop), started=True, next_prefill=2, timeline=[1, 2, 3])
        assert job.decoding
        job.ended = True  # failed in a pass earlier in the round (its cache is gone): no batch takes it
        assert not job.decoding
    finally:
        loop.close()


class Rounds:
    """The worker's passes, logged: "round" as it plans a round, "batch" for each batched decode pass
    ("ridden" for a batch whose steps rode in a prompt chunk's pass), a request's id for each step of
    its own. :meth:`hold_first_batch` holds the next round's first
    batch until :meth:`go_on` (the worker thread waits there; the test acts meanwhile)."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        from prismgate.engines.hf import scheduler as scheduling

        self.log: list[str] = []
        self.blocked = -1  # where in the log the held batch is
        self._hold, self._held, self._go_on = threading.Event(), threading.Event(), threading.Event()
        decode, paced, step = scheduling.decode_batch, engine._scheduler._paced, engine._scheduler.stepper.step

        def logged_decode(stepper: Any, jobs: Any, ridden: Any = None) -> None:
            first_of_round = self.log[-1] == "round"
            self.log.append("batch" if ridden is None else "ridden")
            if self._hold.is_set() and first_of_round and not self._held.is_set():
                self.blocked = len(self.log) - 1
                self._held.set()
                self._go_on.wait(60)
            decode(stepper, jobs, ridden)

        def logged_paced() -> Any:
            self.log.append("round")
            return paced()

        def logged_step(job: Any, chunk: Any = None, riders: Any = None) -> None:
            self.log.append(job.request.request_id)
            step(job, chunk, riders)

        monkeypatch.setattr(scheduling, "decode_batch", logged_decode)
        monkeypatch.setattr(engine._scheduler, "_paced", logged_paced)
        monkeypatch.setattr(engine._scheduler.stepper, "step", logged_step)

    async def hold_first_batch(self) -> None:
        await until(lambda: self.log.count("batch") >= 6)  # all four decode, two batches a round
        self._hold.set()
        await until(self._held.is_set)

    def go_on(self) -> None:
        self._go_on.set()

    def after_blocked(self, n: int) -> list[str]:
        return self.log[self.blocked + 1 : self.blocked + 1 + n]


async def test_a_newcomer_whose_prompt_takes_more_than_a_chunk_begins_next_round(
    tiny_model_dir: Path, tiny_pack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As below, but the newcomer's prompt is longer than a chunk (prefill_chunk 16): its first token is
    rounds away, so it does not hold up the round's second batch; it begins the next round."""
    eng = TransformersEngine(
        tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, max_batch=2, prefill_chunk=16
    )
    await eng.start()
    rounds = Rounds(eng, monkeypatch)
    long = prompts(eng)[3] * 2
    await arrive_mid_round(eng, rounds, long)
    assert len(long) > 16
    assert rounds.after_blocked(3) == ["batch", "round", "newcomer"], rounds.log[rounds.blocked - 2 :]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_a_newcomer_that_arrives_mid_round_cuts_in_at_the_next_pass(
    tiny_model_dir: Path, tiny_pack: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """Four requests decode in two batches a round (max_batch 2); one arrives during the round's first
    batch: its first step runs before the round's second batch, not after the round, and that batch's
    steps ride in its pass where decode steps ride (here in bfloat16, not float32: test_mixed_pass)."""
    eng = TransformersEngine(
        tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, max_batch=2, dtype=dtype, device="cpu"
    )
    await eng.start()
    rides = eng.info.mixed_passes
    rounds = Rounds(eng, monkeypatch)
    await arrive_mid_round(eng, rounds, prompts(eng)[0])
    assert rounds.after_blocked(2) == ["newcomer", "ridden" if rides else "batch"], rounds.log[rounds.blocked - 2 :]


async def test_a_newcomer_waits_for_the_round_while_the_request_preempted_for_its_memory_has_a_pass_in_it(
    tiny_model_dir: Path, tiny_pack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the core preempts the round's last request for the newcomer's memory during the
    first batch: that request's keys and values go only after its own batch has run, so the newcomer
    begins the next round. Nobody fails, and the preempted request, let go, answers as alone."""
    eng = TransformersEngine(tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, max_batch=2)
    await eng.start()
    spec = GenerateSpec(max_tokens=48, ignore_eos=True)
    try:
        alone = [await collect(eng.generate(EngineRequest(f"r{i}", p, spec))) for i, p in enumerate(prompts(eng))]
        rounds = Rounds(eng, monkeypatch)
        requests = [EngineRequest(f"s{i}", p, spec) for i, p in enumerate(prompts(eng))]
        running = [asyncio.create_task(collect(eng.generate(r))) for r in requests]
        await rounds.hold_first_batch()
        assert eng.hold(requests[3], True, drop=True)  # in the round's second batch, still to run
        newcomer = EngineRequest(request_id="newcomer", tokens=prompts(eng)[0], spec=GenerateSpec(max_tokens=2))
        arriving = asyncio.create_task(collect(eng.generate(newcomer)))
        await until(lambda: bool(eng._scheduler._inbox))
        rounds.go_on()
        await asyncio.wait_for(arriving, 60)
        eng.hold(requests[3], False)
        together = await asyncio.wait_for(asyncio.gather(*running), 120)
    finally:
        rounds.go_on()
        await eng.close()
    assert rounds.after_blocked(3) == ["batch", "round", "newcomer"], rounds.log[rounds.blocked - 2 :]
    assert eng.stats["dropped_tokens"] > 0
    assert [[e.id for e in events] for events in together] == [[e.id for e in events] for events in alone]


async def arrive_mid_round(eng: Any, rounds: Rounds, tokens: tuple[int, ...]) -> None:
    """Four requests decode; a newcomer of ``tokens`` arrives while the worker holds a round's first batch."""
    try:
        running = [asyncio.create_task(run(eng, p, max_tokens=48, ignore_eos=True)) for p in prompts(eng)]
        await rounds.hold_first_batch()
        newcomer = EngineRequest(request_id="newcomer", tokens=tokens, spec=GenerateSpec(max_tokens=2))
        arriving = asyncio.create_task(collect(eng.generate(newcomer)))
        await until(lambda: bool(eng._scheduler._inbox))
        rounds.go_on()
        await asyncio.wait_for(asyncio.gather(arriving, *running), 120)
    finally:
        rounds.go_on()
        await eng.close()


async def collect(events: Any) -> list[Any]:
    return [event for event in [e async for e in events] if isinstance(event, TokenEvent)]
