"""/metrics on a real server: every count the monitor keeps, read back through Prometheus's parser."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import FinishReason
from tests.conftest import TINY_MODEL_ID
from tests.ops.helpers import action, collect, scrape, value

MODEL = TINY_MODEL_ID


def tokens_of(server: Any, text: str) -> list[int]:
    return list(server.service.info().tokenizer.encode(text))


def test_generation_counts_and_latencies(live_server: Any) -> None:
    proto = "ops-counts"
    prompt = tokens_of(live_server, "hello there")
    events, done = live_server.call(
        collect(live_server.service.run(action(prompt, max_tokens=6, ignore_eos=True, origin=proto)))
    )
    decoded = [e for e in events if not e.is_prefill]
    assert done.finish_reason is FinishReason.LENGTH and len(decoded) == 6

    s = scrape(live_server.http_url)
    assert value(s, "prismgate_requests_total", protocol=proto, model=MODEL) == 1
    assert value(s, "prismgate_streamed_tokens_total", protocol=proto, model=MODEL) == 6
    assert value(s, "prismgate_prompt_tokens_total", protocol=proto, model=MODEL) == done.prompt_tokens == len(prompt)
    assert value(s, "prismgate_prompt_cached_tokens_total", protocol=proto, model=MODEL) == done.cached_tokens
    assert value(s, "prismgate_prompt_prefilled_tokens_total", protocol=proto, model=MODEL) == done.prefilled_tokens
    assert value(s, "prismgate_generations_finished_total", protocol=proto, finish_reason="length", model=MODEL) == 1
    assert value(s, "prismgate_time_to_first_token_seconds_count", protocol=proto, model=MODEL) == 1
    assert value(s, "prismgate_inter_token_latency_seconds_count", protocol=proto, model=MODEL) == 5
    assert value(s, "prismgate_generation_duration_seconds_count", protocol=proto, model=MODEL) == 1
    ttft = value(s, "prismgate_time_to_first_token_seconds_sum", protocol=proto, model=MODEL)
    total = value(s, "prismgate_generation_duration_seconds_sum", protocol=proto, model=MODEL)
    assert 0 < ttft <= total
    assert value(s, "prismgate_active_sessions", protocol=proto) == 0
    # the model and engine, and how long the model took to load
    assert value(s, "prismgate_model_info", model="tiny-llama", engine="transformers", max_model_len="512") == 1
    assert value(s, "prismgate_model_load_seconds") > 0
    assert value(s, "prismgate_ready") == 1
    assert value(s, "prismgate_engine_max_active") == 64
    assert value(s, "prismgate_engine_preemptions_total") == 0
    assert value(s, "prismgate_engine_preemption_recomputes_total") == 0
    # every known protocol has its series for the served model from the start
    for known in ("salience", "evergreen", "graphpipe", "openai"):
        assert ("prismgate_requests_total", (("model", MODEL), ("protocol", known))) in s
        assert ("prismgate_active_sessions", (("protocol", known),)) in s


def test_prefix_cache_reuse_is_counted(live_server: Any) -> None:
    """A second turn on a session reuses the first turn's cache; the counters say how much."""
    proto = "ops-cache"
    service = live_server.service
    session = live_server.call(service.open(service.pool.default_model))
    first = tokens_of(live_server, "the first turn of a chat")
    _, done1 = live_server.call(collect(service.generate(session.id, action(first, max_tokens=4, origin=proto))))
    second = tokens_of(live_server, " and a second one")
    _, done2 = live_server.call(collect(service.generate(session.id, action(second, max_tokens=4, origin=proto))))
    live_server.call(service.close(session.id))
    assert done2.cached_tokens > 0, "the engine should reuse the session's cache on the second turn"
    s = scrape(live_server.http_url)
    assert value(s, "prismgate_prompt_cached_tokens_total", protocol=proto) == done1.cached_tokens + done2.cached_tokens
    assert (
        value(s, "prismgate_prompt_prefilled_tokens_total", protocol=proto)
        == done1.prefilled_tokens + done2.prefilled_tokens
    )
    assert value(s, "prismgate_requests_total", protocol=proto) == 2


def test_readout_tokens_are_counted(live_server: Any) -> None:
    proto = "ops-readouts"
    prompt = tokens_of(live_server, "look inside")
    events, _ = live_server.call(
        collect(live_server.service.run(action(prompt, max_tokens=3, origin=proto, readouts=True, ignore_eos=True)))
    )
    with_readout = sum(1 for e in events if e.readout is not None)
    assert with_readout == len(prompt) + 3
    assert value(scrape(live_server.http_url), "prismgate_readout_tokens_total", protocol=proto) == with_readout


def test_errors_are_counted_by_code(live_server: Any) -> None:
    proto = "ops-errors"

    async def missing_session() -> None:
        await collect(live_server.service.generate("no-such-session", action([1, 2], origin=proto)))

    with pytest.raises(GatewayError) as err:
        live_server.call(missing_session())
    assert err.value.code is Code.NOT_FOUND
    too_long = action([1] * 600, max_tokens=1, origin=proto)
    with pytest.raises(GatewayError) as err:
        live_server.call(collect(live_server.service.run(too_long)))
    assert err.value.code is Code.RESOURCE_EXHAUSTED
    s = scrape(live_server.http_url)
    # the session was never found, so neither was its model: counted under model ""
    assert value(s, "prismgate_request_errors_total", protocol=proto, code="NOT_FOUND", model="") == 1
    assert value(s, "prismgate_requests_total", protocol=proto, model="") == 1
    # the model was known when the prompt was measured against its context
    assert value(s, "prismgate_request_errors_total", protocol=proto, code="RESOURCE_EXHAUSTED", model=MODEL) == 1
    assert value(s, "prismgate_requests_total", protocol=proto, model=MODEL) == 1
    assert value(s, "prismgate_requests_total", protocol=proto) == 2
    assert value(s, "prismgate_active_sessions", protocol=proto) == 0


def test_client_leaving_counts_as_cancelled(live_server: Any) -> None:
    proto = "ops-cancel"

    async def leave_after_two() -> int:
        seen = 0
        stream = live_server.service.run(action([5, 6, 7], max_tokens=50, ignore_eos=True, origin=proto))
        async for event in stream:
            if not getattr(event, "is_prefill", True):
                seen += 1
                if seen == 2:
                    break
        await stream.aclose()
        return seen

    assert live_server.call(leave_after_two()) == 2
    s = scrape(live_server.http_url)
    assert value(s, "prismgate_generations_finished_total", protocol=proto, finish_reason="cancelled") == 1
    assert value(s, "prismgate_streamed_tokens_total", protocol=proto) == 2
    assert value(s, "prismgate_active_sessions", protocol=proto) == 0
    assert value(s, "prismgate_generations_finished_total", protocol=proto, finish_reason="cancelled", model=MODEL) == 1
    assert not [key for key in s if key[0] == "prismgate_request_errors_total" and ("protocol", proto) in key[1]]


def test_queue_depth_and_active_sessions_while_busy(server_factory: Any) -> None:
    """With one engine slot, a second generation waits in the admission queue: the gauges show it."""
    proto = "ops-queue"
    with server_factory(max_active=1) as server:
        prompt = [3, 4, 5]
        slow = action(prompt, max_tokens=400, ignore_eos=True, origin=proto)

        async def start_two() -> list[asyncio.Task[Any]]:
            return [asyncio.ensure_future(collect(server.service.run(slow))) for _ in range(2)]

        tasks = server.call(start_two())
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            s = scrape(server.http_url)
            seen = {
                "queued": value(s, "prismgate_engine_queue_depth"),
                "active": value(s, "prismgate_engine_active_requests"),
                "sessions": value(s, "prismgate_active_sessions", protocol=proto),
            }
            if seen == {"queued": 1, "active": 1, "sessions": 2}:
                break
            time.sleep(0.02)
        assert seen == {"queued": 1, "active": 1, "sessions": 2}

        async def cancel(ts: list[asyncio.Task[Any]]) -> None:
            for t in ts:
                t.cancel()
            await asyncio.gather(*ts, return_exceptions=True)

        server.call(cancel(tasks))
        s = scrape(server.http_url)
        assert value(s, "prismgate_engine_queue_depth") == 0
        assert value(s, "prismgate_active_sessions", protocol=proto) == 0
        assert value(s, "prismgate_generations_finished_total", protocol=proto, finish_reason="cancelled") == 2


def test_openmetrics_on_request(live_server: Any) -> None:
    import httpx

    r = httpx.get(f"{live_server.http_url}/metrics", headers={"accept": "application/openmetrics-text"}, timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


def test_a_client_cannot_create_a_model_series(live_server: Any) -> None:
    """Model names clients send are never label values: an unknown one counts under model ""."""
    proto = "ops-unknown-model"
    for name in ("gpt-4", "a" * 200):
        with pytest.raises(GatewayError) as err:
            live_server.call(collect(live_server.service.run(action([1, 2], origin=proto), model=name)))
        assert err.value.code is Code.NOT_FOUND
    body = {"model": "gpt-4o-client-made", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    before = value(scrape(live_server.http_url), "prismgate_request_errors_total", protocol="openai", model="")
    refused = httpx.post(live_server.http_url + "/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 404
    s = scrape(live_server.http_url)
    assert value(s, "prismgate_request_errors_total", protocol=proto, code="NOT_FOUND", model="") == 2
    assert value(s, "prismgate_requests_total", protocol=proto, model="") == 2
    assert value(s, "prismgate_request_errors_total", protocol="openai", model="") == before + 1
    models = {dict(labels).get("model") for _, labels in s} - {None}
    assert models <= {"", MODEL}, models
    assert "gpt-4" not in httpx.get(live_server.http_url + "/metrics", timeout=10).text
