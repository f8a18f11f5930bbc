"""The memory budget: each request's worst case from its spec, admitted while the sum fits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineInfo, ReadoutManifest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.fairness import FairQueue, Share
from prismgate.core.memory import AUTO_MAX, AUTO_MIN, MemoryBudget, covered, default_budget, request_bytes

INFO = EngineInfo(
    model_id="m",
    max_model_len=4096,
    vocab_size=49152,
    eos_token_ids=(0,),
    tokenizer=None,  # type: ignore[arg-type]
    readouts=ReadoutManifest(concepts=tuple(f"c{i}" for i in range(256)), layers=(0, 1), hidden_size=64),
)


def test_covered_counts_each_position_once() -> None:
    ranges = (PositionRange(0, 10), PositionRange(5, 20), PositionRange(30, 40), PositionRange(90, 200))
    assert covered(ranges, 100) == 20 + 10 + 10
    assert covered((), 100) == 0


def test_the_estimate_grows_with_what_a_request_reports() -> None:
    plain = request_bytes(GenerateSpec(max_tokens=16), 3516, INFO)
    everything = PositionRange(0, 3532)
    logprobs = GenerateSpec(max_tokens=16, logprob_ranges=(everything,), logprob_top_k=20)
    both = GenerateSpec(max_tokens=16, logprob_ranges=(everything,), logprob_top_k=20, readout_ranges=(everything,))
    sizes = [plain, request_bytes(logprobs, 3516, INFO), request_bytes(both, 3516, INFO)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3
    assert sizes[0] < 1 << 20 < 150 << 20 < sizes[2]  # a plain request is small; the request is not


def test_the_default_is_sized_to_the_machine() -> None:
    assert AUTO_MIN <= default_budget() <= AUTO_MAX
    assert MemoryBudget(0).limit == default_budget() and MemoryBudget(5 << 20).limit == 5 << 20


async def test_a_request_over_the_whole_budget_is_refused_naming_the_setting() -> None:
    budget = MemoryBudget(10 << 20)
    with pytest.raises(GatewayError) as refused:
        async with budget.reserve(11 << 20):
            pass
    assert refused.value.code is Code.RESOURCE_EXHAUSTED and "memory_budget_bytes" in refused.value.message
    assert budget.used == 0


async def test_requests_wait_until_their_bytes_fit_and_small_ones_go_ahead() -> None:
    budget = MemoryBudget(10 << 20)
    order: list[str] = []
    first_done = asyncio.Event()

    async def run(name: str, size: int, hold: asyncio.Event | None = None) -> None:
        async with budget.reserve(size):
            order.append(name)
            assert budget.used <= budget.limit
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(run("a", 8 << 20, first_done))
    await asyncio.sleep(0)
    later = [asyncio.create_task(run(n, s)) for n, s in (("b", 4 << 20), ("c", 1 << 20))]
    await asyncio.sleep(0.01)
    assert order == ["a", "c"] and budget.waiting == 1  # c fits beside a; b waits for a
    first_done.set()
    await asyncio.gather(first, *later)
    assert order == ["a", "c", "b"] and budget.used == 0


async def test_a_cancelled_waiter_leaves_no_bytes_held() -> None:
    budget = MemoryBudget(10 << 20)
    release = asyncio.Event()

    async def hold() -> None:
        async with budget.reserve(9 << 20):
            await release.wait()

    holder = asyncio.create_task(hold())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(budget.reserve(5 << 20).__aenter__())
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    release.set()
    await holder
    assert budget.used == 0 and budget.waiting == 0


def test_sae_features_count_in_the_estimate() -> None:
    from dataclasses import replace

    from prismgate.core.features import FeatureManifest, FeatureSpec

    info = replace(INFO, features=FeatureManifest(layers=(3, 7), widths=(4096, 4096)))
    everything = (PositionRange(0, 1 << 20),)
    plain = request_bytes(GenerateSpec(max_tokens=16), 3516, info)
    top = GenerateSpec(max_tokens=16, features=FeatureSpec(top_k=64, ranges=everything))
    one_layer = GenerateSpec(max_tokens=16, features=FeatureSpec(top_k=64, layers=(3,), ranges=everything))
    watched = GenerateSpec(max_tokens=16, features=FeatureSpec(top_k=64, ids=tuple(range(256)), ranges=everything))
    sizes = [request_bytes(s, 3516, info) for s in (one_layer, top, watched)]
    assert plain < sizes[0] < sizes[1] < sizes[2]
    assert sizes[1] - plain == 3532 * 2 * 64 * 400  # positions x layers (all, when none named) x entries x bytes
    assert request_bytes(top, 3516, INFO) == plain  # a model without SAEs reports none


SMOL_KV = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M in bf16: layers x (keys, values) x kv heads x head size x bytes


def test_the_keys_and_values_of_the_prompt_and_max_tokens_count() -> None:
    from dataclasses import replace

    smol = replace(INFO, kv_bytes_per_token=SMOL_KV)
    plain = GenerateSpec(max_tokens=16)
    assert request_bytes(plain, 3516, smol) - request_bytes(plain, 3516, INFO) == 3532 * SMOL_KV  # 81 MB
    longer = GenerateSpec(max_tokens=1016)
    assert request_bytes(longer, 3516, smol) - request_bytes(plain, 3516, smol) == 1000 * SMOL_KV
    blocks = replace(smol, kv_block_tokens=256)  # the engine holds keys and values in blocks of 256 positions
    assert request_bytes(plain, 3516, blocks) - request_bytes(plain, 3516, INFO) == 3584 * SMOL_KV  # 14 blocks
    assert request_bytes(GenerateSpec(max_tokens=12), 500, blocks) - request_bytes(plain, 500, INFO) == 512 * SMOL_KV


async def test_the_default_admits_a_whole_context_of_the_largest_model_and_a_set_budget_stays() -> None:
    from dataclasses import replace

    big = replace(INFO, max_model_len=131072, kv_bytes_per_token=SMOL_KV)  # 3 GB of keys and values at full length
    whole = request_bytes(GenerateSpec(max_tokens=0), 131072, big)
    auto, fixed = MemoryBudget(0), MemoryBudget(5 << 20)
    auto.fit([INFO, big])
    fixed.fit([INFO, big])
    assert auto.limit == max(default_budget(), whole) == whole and fixed.limit == 5 << 20
    async with auto.reserve(whole):  # a prompt as long as the model takes fits alone
        assert auto.used == whole
    small = MemoryBudget(0)
    small.fit([INFO])  # a small model's context needs no more than the machine's share
    assert small.limit == default_budget()


async def test_an_answer_hold_keeps_an_ended_generations_bytes_until_released() -> None:
    from prismgate.core.memory import hold_answer

    budget = MemoryBudget(10 << 20)

    async def answer() -> int:
        hold = hold_answer()  # in this task's context only
        async with budget.reserve(6 << 20):
            pass
        kept = budget.used
        hold.release()
        hold.release()  # idempotent
        async with budget.reserve(1 << 20):  # after the release a generation frees its bytes as it ends
            pass
        return kept

    assert await asyncio.create_task(answer()) == 6 << 20
    assert budget.used == 0
    async with budget.reserve(2 << 20):  # outside any hold: freed at once
        pass
    assert budget.used == 0


async def test_make_room_lends_a_paused_requests_bytes_to_the_newcomer_ahead_of_the_waiters() -> None:
    """A preemption for memory: the paused request's keys and values are lent to the newcomer, who takes
    them before older waiters; the paused one claims them back in its old place in line (ahead of a
    later waiter), and leaving withdraws a claim."""
    budget = MemoryBudget(10)
    events: list[str] = []
    release = {name: asyncio.Event() for name in ("a", "w", "n")}
    held: dict[str, Any] = {}

    async def run(name: str, size: int, make_room: Any = None) -> None:
        async with budget.reserve(size, make_room) as memory:
            held[name] = memory
            events.append(name)
            await release[name].wait()

    a = asyncio.create_task(run("a", 8))
    await asyncio.sleep(0)
    w = asyncio.create_task(run("w", 4))  # waits: 8 + 4 > 10
    await asyncio.sleep(0)

    def make_room(short: int) -> None:
        assert short == 4
        held["a"].lend(4)
        held["a"].regain(4, lambda: events.append("a regained"))

    n = asyncio.create_task(run("n", 6, make_room))
    await asyncio.sleep(0.01)
    assert events == ["a", "n"] and budget.used == 10 and budget.waiting == 2 and held["a"].held == 4
    release["n"].set()
    await n
    await asyncio.sleep(0.01)
    assert events == ["a", "n", "a regained"] and budget.used == 8 and held["a"].held == 8  # a came before w
    release["a"].set()
    await a
    await asyncio.sleep(0.01)
    assert events[-1] == "w" and budget.used == 4
    release["w"].set()
    await w
    assert budget.used == 0

    # a request that leaves while its claim waits withdraws it and frees what it holds
    release["b"], release["c"] = asyncio.Event(), asyncio.Event()
    blocker = asyncio.create_task(run("b", 10))
    await asyncio.sleep(0)
    held["b"].lend(3)
    other = asyncio.create_task(run("c", 3))  # takes the lent bytes
    await asyncio.sleep(0)
    held["b"].regain(3, lambda: events.append("never"))
    assert budget.used == 10 and budget.waiting == 1
    blocker.cancel()  # b's client leaves
    with pytest.raises(asyncio.CancelledError):
        await blocker
    await asyncio.sleep(0.01)
    assert budget.used == 3 and budget.waiting == 0 and "never" not in events
    release["c"].set()
    await other
    assert budget.used == 0


async def test_waiters_are_granted_in_the_order_of_their_keys_standing() -> None:
    """With the pool's fair queue, freed bytes go to the waiter of the key served least first, whatever the
    arrival order; within a key, oldest first. A key that starts waiting banks no credit."""
    fair = FairQueue()
    fair.charge(Share("a"), 500)
    budget = MemoryBudget(10, fair=fair)
    order: list[str] = []
    release = asyncio.Event()

    async def run(name: str, key: str, size: int, hold: asyncio.Event | None = None) -> None:
        async with budget.reserve(size, key=key):
            order.append(name)
            if hold is not None:
                await hold.wait()

    first = asyncio.create_task(run("a0", "a", 10, release))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(run(n, k, 6)) for n, k in (("a1", "a"), ("a2", "a"), ("b0", "b"), ("b1", "b"))]
    await asyncio.sleep(0.01)
    assert order == ["a0"] and budget.waiting == 4
    assert fair.served("b") == 0.0  # nobody was admitted from the fair queue yet: nothing to catch up to
    fair.charge(Share("b"), 10)
    release.set()
    await asyncio.gather(first, *waiters)
    assert order == ["a0", "b0", "b1", "a1", "a2"] and budget.used == 0
