"""ActionEngine's own client (PyPI ``action-engine``, unchanged) against ``/evergreen`` on a live gateway.

One server for the module (the tiny model, a keys file: ``user`` without limits and
``slow`` with a token rate). The client authenticates as its docs allow a WebSocket
target to: ``/evergreen?access_token=...``. Hostile frames come from a plain WebSocket
client, written byte by byte with msgpack (:mod:`tests.actionengine.frames`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import actionengine
import httpx
import msgpack
import pytest
import websockets

from prismgate.keys import entry_toml
from tests.actionengine import frames
from tests.actionengine.client import Client, read_all, register_output_mimes
from tests.conftest import TINY_MODEL_ID, LiveServer

KEYS = {"user": "k-ae-user-0123456789abcdef", "slow": "k-ae-slow-0123456789abcdef"}
QUESTION = "What is the capital of France?"
# the refusal reaches the client's read in well under this (about 50 ms measured); the bound only
# makes a read that would wait for ever fail instead (1 s was too tight once: a CI run whose other
# lanes built images and a virtualenv beside the tests left one refused client without an answer)
REFUSAL_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def server(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    keys = tmp_path_factory.mktemp("ae-keys") / "keys.toml"
    keys.write_text(
        entry_toml("user", KEYS["user"], {}) + "\n" + entry_toml("slow", KEYS["slow"], {"tokens_per_minute": 20})
    )
    register_output_mimes()
    with server_factory(keys_file=str(keys)) as running:
        yield running


def port(server: LiveServer) -> int:
    return int(server.http_url.rsplit(":", 1)[1])


def openai_answer(server: LiveServer, messages: list[dict[str, str]], max_tokens: int) -> str:
    body = {"model": TINY_MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "messages": messages}
    headers = {"authorization": f"Bearer {KEYS['user']}"}
    answer = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["message"]["content"])


async def test_a_streamed_generate_is_the_greedy_openai_answer_and_a_second_action_reuses_the_session(
    server: LiveServer,
) -> None:
    client = Client(port(server), KEYS["user"])
    try:
        first = await client.generate(QUESTION, {"maxTokens": 6}, outputs=("response", "usage"))
        pieces = await read_all(first["response"])
        usage = (await read_all(first["usage"]))[0]
        await first.wait_until_complete()  # the OK status the action ends with
        assert len(pieces) >= 2, "the answer streams token by token"
        answer = "".join(pieces)
        assert answer == openai_answer(server, [{"role": "user", "content": QUESTION}], 6)
        assert usage["completionTokens"] == 6 and usage["reusedTokens"] == 0

        follow_up = "And of Italy?"
        conversation = [("user", QUESTION), ("assistant", answer), ("user", follow_up)]
        second = await client.generate(conversation, {"maxTokens": 4}, outputs=("response", "usage"))
        text = "".join(await read_all(second["response"]))
        again = (await read_all(second["usage"]))[0]
        messages = [{"role": r, "content": t} for r, t in conversation]
        assert text == openai_answer(server, messages, 4)
        # the session kept the first turn: only what follows it is prefilled
        assert again["reusedTokens"] >= usage["promptTokens"]
        assert again["prefilledTokens"] < again["promptTokens"] - usage["promptTokens"] + 2
    finally:
        client.close()


async def test_readouts_and_logprobs_come_through_extra_output_ports(server: LiveServer) -> None:
    client = Client(port(server), KEYS["user"])
    try:
        action = await client.generate(
            "Hello", {"maxTokens": 3, "topLogprobs": 2}, outputs=("response", "readouts", "logprobs")
        )
        text = "".join(await read_all(action["response"]))
        readouts = await read_all(action["readouts"])
        logprobs = await read_all(action["logprobs"])
    finally:
        client.close()
    header, lines = readouts[0], readouts[1:]
    assert header["model"] == TINY_MODEL_ID and header["shape"] == ["layers", "concepts"]
    assert len(lines) == 3 and [line["index"] for line in lines] == [0, 1, 2]
    assert all(len(line["values"]) == len(header["layers"]) for line in lines)
    assert all(len(row) == len(header["concepts"]) for line in lines for row in line["values"])
    assert [line["tokenId"] for line in logprobs] == [line["tokenId"] for line in lines]
    assert all(len(line["top"]) == 2 and line["logprob"] <= 0 for line in logprobs)
    assert text.startswith("".join(line["text"] for line in logprobs))  # the end may add held-back bytes


async def refused(action: Any) -> str:
    """The error the client reads from the response, within the bound."""
    with pytest.raises(actionengine.status.StatusNotOk) as error:
        await action["response"].consume(timeout=REFUSAL_WITHIN_S)
    return str(error.value)


async def test_a_bad_setting_is_reported_to_the_client(server: LiveServer) -> None:
    client = Client(port(server), KEYS["user"])
    try:
        action = await client.generate(QUESTION, {"maxTokens": 3, "temprature": 0.5})
        message = await refused(action)
        assert "unknown config field 'temprature'" in message and "INVALID_ARGUMENT" in message
        with pytest.raises(actionengine.status.StatusNotOk, match="temprature"):
            await action.wait_until_complete()  # the status node carries the same error
    finally:
        client.close()


async def test_an_unauthenticated_client_is_told_so(server: LiveServer) -> None:
    for token in (None, "k-nobody"):
        client = Client(port(server), token)
        try:
            action = await client.generate(QUESTION, {"maxTokens": 3})
            assert "UNAUTHENTICATED" in await refused(action)
        finally:
            client.close()


async def test_a_key_over_its_token_rate_is_told_so(server: LiveServer) -> None:
    async def generate_as_slow(within_s: float) -> str | None:
        """The error the client reads, or None when the generation ran."""
        client = Client(port(server), KEYS["slow"])
        try:
            action = await client.generate(QUESTION, {"maxTokens": 2})
            try:
                await read_all(action["response"], within_s)
            except actionengine.status.StatusNotOk as error:
                return str(error)
            return None
        finally:
            client.close()

    assert await generate_as_slow(60) is None  # its prompt alone is over the key's 20 tokens a minute
    # the minute may turn between the two: that one uses up the new window
    message = await generate_as_slow(REFUSAL_WITHIN_S) or await generate_as_slow(REFUSAL_WITHIN_S)
    assert message is not None and "RESOURCE_EXHAUSTED" in message and "tokens_per_minute" in message, message


# -- the wire, byte by byte ---------------------------------------------------------------------------


async def exchange(server: LiveServer, *sent: bytes, replies: int = 0) -> tuple[list[bytes], int | None, str]:
    """Send raw frames; the binary replies (up to ``replies``, then until the close), close code and reason."""
    url = f"{server.ws_url}/evergreen?access_token={KEYS['user']}"
    received: list[bytes] = []
    async with websockets.connect(url, max_size=None) as ws:
        for frame in sent:
            await ws.send(frame)
        try:
            async with asyncio.timeout(60):
                while True:
                    reply = await ws.recv()
                    assert isinstance(reply, bytes)
                    received.append(reply)
                    if replies and len(received) == replies:
                        break
        except websockets.ConnectionClosed:
            pass
        await ws.close()
        code = ws.close_code if ws.close_code != 1000 or not replies else None
        return received, code, ws.close_reason or ""


@pytest.mark.parametrize("release", [True, False], ids=["0.4.0", "head"])
async def test_the_answer_is_written_in_the_layout_the_client_used(server: LiveServer, release: bool) -> None:
    sent = [
        frames.generate("a1", config=True, release=release),
        frames.text("a1#config", '{"maxTokens": 3}', release=release),
        frames.text("a1#prompt", "Hi", release=release),
        frames.half_close(release),
    ]
    received, code, _ = await exchange(server, *sent)
    assert code in (None, 1000)
    decoded = [frames.read(r, release=release) for r in received]
    assert decoded[-1] == ([], [])  # the half-close answered with an empty message, after everything else
    ids = [f["id"] for fragments, _ in decoded[:-1] for f in fragments]
    assert ids[-1] == "a1#__status__" and set(ids[:-1]) == {"a1#response"}
    status = next(f for fragments, _ in decoded for f in fragments if f["id"] == "a1#__status__")
    assert status["mimetype"] == "__status__" and status["data"] == b"\x00"  # OK
    response = [f for fragments, _ in decoded for f in fragments if f["id"] == "a1#response"]
    assert [f["seq"] for f in response] == list(range(len(response)))
    assert all(f["mimetype"] == "text/plain" for f in response[:-1]) and not response[-1]["continued"]


HOSTILE = {
    "a length field of 2^31": (frames.bin_header(2**31) + b"\x90\x90", 4400, "bin announces 2147483648 bytes"),
    "2^31 fragments announced": (frames.wrap(b"\xdd" + (2**31).to_bytes(4, "big")), 4429, "2147483648 node fragments"),
    "a million nested arrays": (frames.wrap(b"\x91" * 10**6), 4400, "must be a msgpack bin, got 0x91"),
    "a 20 MB chunk": (frames.text("x#prompt", "a" * (20 << 20), release=True), 4429, "the limit is"),
    "a truncated frame": (frames.text("x#prompt", "Hi", release=True)[:-3], 4400, "but"),
    "a truncated fragment": (frames.wrap(b"\x91" + msgpack.packb(b"\x00\xc4\x05")), 4400, "truncated"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
async def test_hostile_frames_are_closed_at_once_and_the_server_goes_on(server: LiveServer, name: str) -> None:
    frame, expected_code, expected_reason = HOSTILE[name]
    async with httpx.AsyncClient() as http:  # a probe while the frame is read, and one after
        (received, code, reason), during = await asyncio.gather(
            exchange(server, frame), http.get(f"{server.http_url}/healthz", timeout=10)
        )
        after = await http.get(f"{server.http_url}/healthz", timeout=10)
    assert received == [] and code == expected_code, (code, reason)
    assert expected_reason in reason, reason
    assert during.status_code == after.status_code == 200


async def test_a_connection_keeps_the_form_of_its_first_frame(server: LiveServer) -> None:
    received, code, reason = await exchange(server, frames.generate("m1", config=True, release=True), b"{}")
    assert code == 4400 and "this connection speaks ActionEngine" in reason, reason
    told = [f for r in received for f in frames.read(r, release=True)[0]]  # the action learns why first
    assert {f["id"] for f in told} == {"m1#response", "m1#__status__"}
    assert all(f["mimetype"] == "__status__" and f["data"][0] == 3 for f in told)  # INVALID_ARGUMENT
    _, code, reason = await exchange(server, b"{}", frames.generate("m2", config=False, release=True))
    assert code == 4400 and "began in Evergreen's form" in reason, reason
