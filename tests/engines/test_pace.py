"""The pace's sizing of a round's prefill, on injected costs (no clock, no model)."""

from __future__ import annotations

import pytest

from prismgate.engines.hf.pace import ALONE, Pace, Prefill

MS = 0.001


def one(key: int = 1, context: int = 0, left: int = 4000, outputs: bool = False) -> Prefill:
    return Prefill(key, context, left, outputs)


def test_alone_a_request_takes_chunks_of_a_few_targets_not_the_ceiling_however_slow() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    assert pace.plan([one(left=500)], others_wait=False) == {1: 512}  # not measured, but it fits: one chunk
    assert pace.plan([one(left=4000)], others_wait=False) == {1: 32}  # not measured: the smallest chunk measures it
    pace.record(0, 512, False, 5.0)  # ten milliseconds a token: a full chunk is 25 times the target
    assert pace.plan([one()], others_wait=False) == {1: 32}  # 50 tokens last 2.5 targets: the floor
    fast = Pace(ceiling=512, target_s=0.2)
    fast.record(0, 512, False, 512 * 0.1 * MS)
    assert fast.plan([one()], others_wait=False) == {1: 512}  # the ceiling bounds it
    assert ALONE == 2.5


def test_chunks_shrink_to_the_target_while_others_wait_and_grow_back_alone() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    assert pace.plan([one()], others_wait=True) == {1: 32}  # not measured yet: the smallest chunk measures it
    pace.record(0, 64, False, 64 * MS)  # a millisecond a token
    assert pace.plan([one()], others_wait=True) == {1: 192}  # 200 tokens fit, aligned down to a multiple of 32
    assert pace.plan([one()], others_wait=False) == {1: 480}  # alone: 2.5 targets' worth, 500 tokens


def test_the_floor_and_the_ceiling_bound_every_chunk() -> None:
    slow = Pace(ceiling=512, target_s=0.2)
    slow.record(0, 64, False, 64 * 100 * MS)  # a tenth of a second a token: even the floor overruns
    assert slow.plan([one()], others_wait=True) == {1: 32}
    assert slow.plan([one()], others_wait=False) == {1: 32}
    fast = Pace(ceiling=512, target_s=0.2)
    fast.record(0, 512, False, 512 * 0.001 * MS)
    assert fast.plan([one()], others_wait=True) == {1: 512}
    small = Pace(ceiling=16, target_s=0.2)  # an operator's prefill_chunk below the floor wins
    small.record(0, 16, False, 16 * 100 * MS)
    assert small.plan([one()], others_wait=True) == {1: 16}


def test_the_moving_estimate_follows_the_measurements() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(0, 64, False, 64 * MS)
    pace.record(100, 64, False, 64 * 3 * MS)  # the same context bucket, now three times dearer
    assert pace.rate(0, False) == pytest.approx(2 * MS)  # half way, with the default weight
    assert pace.plan([one()], others_wait=True) == {1: 96}


def test_deeper_contexts_and_scored_prompts_are_costed_apart() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(0, 128, False, 128 * MS)
    pace.record(3000, 64, False, 64 * 4 * MS)
    pace.record(0, 64, True, 64 * 2 * MS)
    assert pace.plan([one(context=100)], others_wait=True) == {1: 192}
    assert pace.plan([one(context=3100)], others_wait=True) == {1: 32}  # 50 tokens fit, aligned down
    assert pace.plan([one(context=100, outputs=True)], others_wait=True) == {1: 96}
    # a bucket not measured yet takes the nearest shallower one's cost
    assert pace.rate(1500, False) == MS
    assert pace.rate(1500, True) == 2 * MS


def test_several_prefilling_requests_take_turns_within_the_round() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(0, 64, False, 64 * 2 * MS)  # two milliseconds a token: 96 tokens fill a round
    prefills = [one(1), one(2), one(3)]
    rounds = [pace.plan(prefills, others_wait=True) for _ in range(6)]
    assert rounds == [{1: 96}, {2: 96}, {3: 96}] * 2  # each round's 200 ms goes to one of them, in turn
    pace.plan([one(4), *prefills], others_wait=True)  # a newcomer steps first, then the turns go on
    assert [pace.plan([one(4), *prefills], others_wait=True) for _ in range(3)] == [{1: 96}, {2: 96}, {3: 96}]


def test_a_request_with_little_left_leaves_the_rest_of_the_round_to_others() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(0, 64, False, 64 * MS)
    assert pace.plan([one(1, left=10), one(2)], others_wait=True) == {1: 192, 2: 160}


def test_two_prefilling_requests_wait_on_each_other_even_with_nothing_else_running() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(0, 64, False, 64 * 2 * MS)
    assert len(pace.plan([one(1), one(2)], others_wait=False)) == 1


def test_a_target_of_zero_turns_the_bound_off() -> None:
    pace = Pace(ceiling=512, target_s=0)
    pace.record(0, 512, False, 5.0)
    assert pace.plan([one(1), one(2), one(3)], others_wait=True) == {1: 512, 2: 512, 3: 512}


def test_requests_that_left_are_forgotten() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(0, 64, False, 64 * 2 * MS)
    pace.plan([one(1), one(2)], others_wait=True)
    pace.plan([one(3)], others_wait=True)
    assert set(pace._served) == {3}


def test_a_deep_chunk_is_costed_at_the_nearest_depth_not_at_a_shallower_one() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(2048, 64, False, 64 * MS)
    pace.record(3300, 64, False, 64 * 3 * MS)  # attention: three times dearer 1,250 positions deeper
    assert pace.plan([one(context=3400)], others_wait=True) == {1: 64}  # at 3 ms a token, not a blend of both
    assert pace.plan([one(context=2100)], others_wait=True) == {1: 192}


def test_a_prompt_is_not_split_to_leave_less_than_the_floor_for_another_round() -> None:
    pace = Pace(ceiling=512, target_s=0.2)
    pace.record(0, 64, False, 64 * 5 * MS)  # five milliseconds a token: 40 tokens fit, 32 once aligned
    assert pace.plan([one(left=4000)], others_wait=True) == {1: 32}
    assert pace.plan([one(left=50)], others_wait=True) == {1: 50}  # not 32 now and 18 a round later
    assert pace.plan([one(left=65)], others_wait=True) == {1: 32}  # 33 left: a chunk of its own
