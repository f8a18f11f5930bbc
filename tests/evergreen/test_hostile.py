"""Hostile Evergreen clients on a real socket: each is refused precisely, before the work it asks
for, while a normal session on the same server completes its turn.

The limits come from the core's RequestBudget (its defaults: no settings needed).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import websockets

from prismgate.core.budget import RequestBudget
from tests.evergreen.wire import Collector, closed_with, generate, msg, parent, text_leaf, uid

BUDGET = RequestBudget()


def connect(server: Any) -> Any:
    return websockets.connect(server.ws_url + "/evergreen", max_size=None)


async def normal_turn(server: Any) -> str:
    """A well-behaved client: one short turn, its text."""
    prompt, response = uid(), uid()
    async with connect(server) as ws:
        await ws.send(
            msg(
                actions=[generate(prompt, response, config={"maxTokens": 3})],
                fragments=[parent(prompt, "q"), text_leaf("q", "Hello")],
            )
        )
        outs = await Collector(ws).until_complete(response, within=60)
    return outs[response].text


async def hostile(server: Any, *messages: str) -> tuple[int, str, float]:
    async with connect(server) as ws:
        started = time.monotonic()
        for m in messages:
            await ws.send(m)
        code, reason = await closed_with(ws)
        return code, reason, time.monotonic() - started


def doubling_dag(levels: int) -> list[dict[str, Any]]:
    """``levels`` nodes, each listing the one below twice: ~100 bytes per level, 2**levels leaves."""
    fragments = [text_leaf("n0", "x")]
    fragments += [parent(f"n{i}", f"n{i - 1}", f"n{i - 1}") for i in range(1, levels + 1)]
    return fragments


async def test_a_node_graph_that_expands_to_millions_of_leaves_is_refused_before_flattening(live_server) -> None:
    levels = 24  # 16.7 million leaves from ~2 KB
    message = msg(actions=[generate(f"n{levels}", "r")], fragments=doubling_dag(levels))
    (code, reason, took), text = await asyncio.gather(hostile(live_server, message), normal_turn(live_server))
    assert code == 4429 and "RESOURCE_EXHAUSTED" in reason and f"{2**levels} leaves" in reason, reason
    assert str(BUDGET.max_expanded_leaves) in reason or "..." in reason
    assert took < 5, f"counting the expansion took {took:.1f}s"
    assert text  # the other session was served meanwhile


async def test_thousands_of_actions_in_one_frame_hit_the_in_flight_cap(live_server) -> None:
    """DROPs queued behind a GENERATE whose input never arrives: capped, and cheap to refuse."""
    n = BUDGET.max_actions_in_flight + 10
    waiting = generate("never", "r")
    drops = [{"name": "DROP", "inputs": [{"name": "x", "id": "never"}]} for _ in range(n)]
    message = msg(actions=[waiting, *drops])
    (code, reason, took), text = await asyncio.gather(hostile(live_server, message), normal_turn(live_server))
    assert code == 4429 and f"{BUDGET.max_actions_in_flight} actions are still running" in reason, reason
    assert took < 5, f"refusing took {took:.1f}s"
    assert text


async def test_a_prompt_larger_than_the_context_could_hold_is_refused_unread(live_server) -> None:
    context = live_server.service.info().max_model_len
    size = BUDGET.prompt_bytes_per_context_token * context + 1
    prompt = uid()
    message = msg(actions=[generate(prompt, "r")], fragments=[parent(prompt, "q"), text_leaf("q", "a" * size)])
    (code, reason, _), text = await asyncio.gather(hostile(live_server, message), normal_turn(live_server))
    assert code == 4429 and "bytes of text" in reason, reason
    assert text


async def test_an_idle_connection_holds_no_core_session(server_factory) -> None:
    with server_factory() as server:
        await idle_connection_holds_no_session(server)


async def idle_connection_holds_no_session(server: Any) -> None:
    store = server.service.store
    before = len(store)
    async with connect(server) as idle:
        await asyncio.sleep(0.3)
        assert len(store) == before  # connected, nothing sent: no session taken
        assert await normal_turn(server)
        await settles(lambda: len(store) == before)  # the other connection's session went with it
        prompt, response = uid(), uid()
        await idle.send(
            msg(
                actions=[generate(prompt, response, config={"maxTokens": 2})],
                fragments=[parent(prompt, "q"), text_leaf("q", "Hi")],
            )
        )
        await Collector(idle).until_complete(response, within=60)
        assert len(store) == before + 1  # the first GENERATE opened it
    await settles(lambda: len(store) == before)  # closing the connection released it


async def settles(condition: Any, within: float = 10.0) -> None:
    """Until ``condition()`` holds: the server closes a connection's session just after the socket."""
    async with asyncio.timeout(within):
        for _ in iter(condition, True):
            await asyncio.sleep(0.05)


async def test_an_open_connection_keeps_its_session_past_the_ttl(server_factory) -> None:
    with server_factory(session_ttl_s=0.5) as server:
        prompt, first, second = uid(), uid(), uid()
        async with connect(server) as ws:
            collector = Collector(ws)
            await ws.send(
                msg(
                    actions=[generate(prompt, first, config={"maxTokens": 2})],
                    fragments=[parent(prompt, "q"), text_leaf("q", "Hi")],
                )
            )
            await collector.until_complete(first, within=60)
            await asyncio.sleep(1.0)  # idle past the TTL
            await server.service.store.evict_expired()
            follow = uid()
            await ws.send(
                msg(
                    actions=[generate(follow, second, extra_outputs={"usage": second + "-u"}, config={"maxTokens": 2})],
                    fragments=[parent(follow, prompt, first, "q2"), text_leaf("q2", "More", role="user")],
                )
            )
            outs = await collector.until_complete(second, second + "-u", within=60)
            usage = json.loads(outs[second + "-u"].data)
            assert usage["reusedTokens"] > 0  # the same session, still holding the first turn
