"""Sessions (prismgate extension) and cancellation when the client goes away."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from prismgate.core.chat import Message, TextPart, render
from tests.conftest import run_server, tiny_settings
from tests.openai.conftest import EOS_FREE, LONG_CONTEXT

MAX_TOKENS = LONG_CONTEXT - 100  # seconds of decoding on the long-context tiny model


def open_session(live_server: Any, model: str) -> str:
    r = httpx.post(live_server.http_url + "/v1/sessions", json={"model": model})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "session" and body["length"] == 0 and body["model"] == model
    return str(body["id"])


def session_info(live_server: Any, session_id: str) -> httpx.Response:
    return httpx.get(f"{live_server.http_url}/v1/sessions/{session_id}")


def engine_idle(live_server: Any, timeout: float = 10.0) -> bool:
    engine = live_server.service.pool.engine()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.in_flight() == 0 and live_server.service.pool.admission.active == 0:
            return True
        time.sleep(0.02)
    return False


def decoded(live_server: Any) -> int:
    return int(live_server.service.pool.engine().stats["decoded_tokens"])


def test_session_turns_send_only_new_messages_and_reuse_the_prefix(
    client: openai.OpenAI, live_server: Any, model: str
) -> None:
    sid = open_session(live_server, model)
    first = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"session_id": sid},
    )
    ext = first.model_extra["prismgate"]
    after_first = ext["session_length"]
    assert ext["session_id"] == sid
    assert after_first == first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    second = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "And then?"}],
        max_tokens=6,
        temperature=0,
        extra_body={"session_id": sid},
    )
    # the model saw the whole conversation, but the engine recomputed only the new part
    assert second.usage.prompt_tokens > after_first
    assert second.usage.prompt_tokens_details.cached_tokens >= after_first - 1
    assert second.model_extra["prismgate"]["session_length"] == session_info(live_server, sid).json()["length"]

    # the timeline is exactly what the chat template makes of the whole conversation
    timeline = live_server.call(live_server.service.dump(sid))
    reply_ids = timeline[first.usage.prompt_tokens : after_first]
    specials = set(live_server.service.info().eos_token_ids) | {257}  # <|im_start|> in the test tokenizer
    if not specials & set(reply_ids[:-1]):  # a random model may emit special tokens mid-reply
        conversation = [
            Message("user", [TextPart("Hi")]),
            Message("assistant", [TextPart(first.choices[0].message.content or "")]),
            Message("user", [TextPart("And then?")]),
        ]
        expected = render(live_server.service, conversation).tokens
        assert timeline[: second.usage.prompt_tokens] == list(expected)

    # the same conversation sent whole, without a session, costs a full prefill
    whole = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then?"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert whole.usage.prompt_tokens_details.cached_tokens == 0

    deleted = httpx.delete(f"{live_server.http_url}/v1/sessions/{sid}")
    assert deleted.status_code == 200 and deleted.json() == {"id": sid, "object": "session.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1, extra_body={"session_id": sid}
        )
    assert e.value.body["code"] == "session_not_found"
    assert session_info(live_server, sid).status_code == 404
    assert httpx.delete(f"{live_server.http_url}/v1/sessions/{sid}").status_code == 404


def test_completions_append_raw_text_to_a_session(client: openai.OpenAI, live_server: Any, model: str) -> None:
    sid = open_session(live_server, model)
    a = client.completions.create(
        model=model, prompt="abc", max_tokens=3, temperature=0, extra_body={"session_id": sid}
    )
    b = client.completions.create(
        model=model, prompt="def", max_tokens=3, temperature=0, extra_body={"session_id": sid}
    )
    length_a = a.model_extra["prismgate"]["session_length"]
    assert b.usage.prompt_tokens == length_a + 3
    timeline = live_server.call(live_server.service.dump(sid))
    tokenizer = live_server.service.info().tokenizer
    assert timeline[length_a : length_a + 3] == tokenizer.encode("def")
    # max_tokens=0 appends without generating: a way to prime a session
    c = client.completions.create(model=model, prompt="g", max_tokens=0, extra_body={"session_id": sid})
    assert c.choices[0].text == "" and c.usage.completion_tokens == 0
    assert live_server.call(live_server.service.dump(sid))[-1:] == tokenizer.encode("g")


def test_session_errors(client: openai.OpenAI, live_server: Any, model: str) -> None:
    assert httpx.post(live_server.http_url + "/v1/sessions", json={"model": "nope"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=1,
            extra_body={"session_id": "does-not-exist"},
        )


def test_busy_session_is_409_and_cancel_rewinds(
    long_server: Any, long_client: openai.OpenAI, model: str, eos_free_prompt: str
) -> None:
    sid = open_session(long_server, model)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": eos_free_prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "session_id": sid,
    }
    with httpx.stream("POST", long_server.http_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # kept referenced: dropping a half-read iterator closes the connection
        seen = 0
        while seen < 2:  # the role chunk, then the first token: the generation is under way
            seen += next(lines).startswith("data: {")
        assert session_info(long_server, sid).json()["busy"] is True
        with pytest.raises(openai.ConflictError) as e:
            long_client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1, extra_body={"session_id": sid}
            )
        assert e.value.body["code"] == "session_busy"
    # leaving the stream closed the connection: the engine stops and the turn is undone
    assert engine_idle(long_server)
    info = session_info(long_server, sid).json()
    assert info["busy"] is False and info["length"] == 0
    # and the session works again
    r = long_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body={"session_id": sid}
    )
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_stops_the_engine(long_server: Any, model: str, eos_free_prompt: str, n: int) -> None:
    assert engine_idle(long_server)
    before = decoded(long_server)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": eos_free_prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "n": n,  # every choice stops
    }
    with httpx.stream("POST", long_server.http_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 3:
                break
    assert engine_idle(long_server)
    # without the cancel the engine would have decoded at least EOS_FREE tokens
    assert 0 < decoded(long_server) - before < EOS_FREE


def test_disconnect_while_waiting_for_a_non_streaming_answer(
    long_server: Any, model: str, eos_free_prompt: str
) -> None:
    assert engine_idle(long_server)
    sid = open_session(long_server, model)
    before = decoded(long_server)
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": eos_free_prompt}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "session_id": sid,
        }
    ).encode()
    port = int(long_server.http_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 10
        while decoded(long_server) == before and time.monotonic() < deadline:
            time.sleep(0.002)
    # the socket is closed: the server notices while waiting for the answer and cancels it
    assert engine_idle(long_server)
    assert 0 < decoded(long_server) - before < EOS_FREE
    info = session_info(long_server, sid).json()
    assert info["busy"] is False and info["length"] == 0, "an abandoned turn leaves the session as it was"


def test_overload_is_503(long_model: tuple[Path, Path], model: str, eos_free_prompt: str) -> None:
    """With one engine slot and no queue, a second concurrent request is turned away (and may retry)."""
    with run_server(tiny_settings(*long_model, max_active=1, max_queued=0)) as server:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": eos_free_prompt}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            c = openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0)
            with c, pytest.raises(openai.InternalServerError) as e:
                c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1)
            assert e.value.status_code == 503
            assert e.value.body["type"] == "server_error"
