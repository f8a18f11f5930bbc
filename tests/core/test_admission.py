"""The pool's admission control: limits, priority order, overload."""

from __future__ import annotations

import asyncio

import pytest

from prismgate.core.errors import Code, GatewayError
from prismgate.core.pool import Admission


async def test_waiters_run_lowest_priority_value_first_then_fifo() -> None:
    adm = Admission(max_active=1, max_queued=10)
    order: list[str] = []
    gate = asyncio.Event()

    async def job(name: str, priority: int) -> None:
        async with adm.slot(priority):
            order.append(name)
            await gate.wait()

    first = asyncio.create_task(job("first", 5))
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(job(n, p)) for n, p in (("batch", 10), ("interactive", 0), ("batch2", 10), ("mid", 3))]
    await asyncio.sleep(0.01)
    assert adm.active == 1 and adm.queued == 4
    gate.set()
    await asyncio.gather(first, *tasks)
    assert order == ["first", "interactive", "mid", "batch", "batch2"]
    assert adm.active == 0


async def test_overload_is_unavailable() -> None:
    adm = Admission(max_active=1, max_queued=1)
    hold = asyncio.Event()

    async def holder() -> None:
        async with adm.slot(0):
            await hold.wait()

    t1 = asyncio.create_task(holder())
    await asyncio.sleep(0)
    t2 = asyncio.create_task(holder())
    await asyncio.sleep(0)
    with pytest.raises(GatewayError) as e:
        async with adm.slot(0):
            pass
    assert e.value.code is Code.UNAVAILABLE and "overloaded" in e.value.message
    hold.set()
    await asyncio.gather(t1, t2)


async def test_a_cancelled_waiter_does_not_leak_its_slot() -> None:
    adm = Admission(max_active=1, max_queued=5)
    hold = asyncio.Event()

    async def holder() -> None:
        async with adm.slot(0):
            await hold.wait()

    t1 = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiter = asyncio.create_task(holder())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    hold.set()
    await t1
    assert adm.active == 0 and adm.queued == 0
    async with adm.slot(0):
        assert adm.active == 1
