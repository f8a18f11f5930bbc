"""Readouts as base64 (float32, float16 on request) and the text form's bytes, on the JSON wires.

The text form is what every client that asks nothing new gets, so its bytes are pinned
against the encoders as they were before the fast paths (kept below as ``old_*``), over
the real default model's readouts and over random and edge-case float32 values. The base64
form must decode to exactly the float32 values the text prints (float16: numpy's rounding of
them); a bad encoding value is refused naming its field.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from prismgate.codecs.evergreen.outputs import number, readout_line
from prismgate.codecs.openai.readouts import values_json
from prismgate.core.events import TokenEvent
from tests.conftest import LiveServer, run_server
from tests.evergreen.wire import Collector, closed_with, generate, msg, text_leaf

# -- the encoders as they were (5b24213): the bytes every existing client reads -----------------


def old_values_json(part: np.ndarray) -> str:
    rows = []
    for row in part.astype(str).tolist():
        text = ",".join(row)
        if "e" in text:
            text = ",".join([s if "e" not in s else repr(float(s)) for s in row])
        rows.append("[" + text + "]")
    return "[" + ",".join(rows) + "]"


def old_readout_line(index: int, event: TokenEvent) -> bytes:
    assert event.readout is not None
    values = [[number(v) for v in row] for row in event.readout.tolist()]
    obj = {"index": index, "position": event.position, "tokenId": event.id, "text": event.text or "", "values": values}
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def edge_cases(rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Random bit patterns, and the values whose printing takes the rare branches."""
    bits = rng.integers(0, 2**32, size=(2000, 4, 3), dtype=np.uint64).astype(np.uint32).view(np.float32)
    yield from np.where(np.isfinite(bits), bits, np.float32(0.5))
    yield from (rng.standard_normal((500, 8, 8)) * rng.choice([1e-6, 1e-3, 1.0, 30.0, 1e5, 1e7], (500, 1, 1))).astype(
        np.float32
    )
    yield np.array([[3.0, -0.0, 0.0], [1e-4, 9.999999e-5, 1e16], [1048576.0, 123456.5, 2.0**-149]], np.float32)


def event(readout: np.ndarray, text: str = 'a "q" \u00e9\n') -> TokenEvent:
    return TokenEvent(id=42, position=7, is_prefill=False, readout=readout, text=text)


def test_text_bytes_are_the_old_encoders_over_random_and_edge_values() -> None:
    for part in edge_cases(np.random.default_rng(3)):
        assert values_json(part) == old_values_json(part)
        assert readout_line(5, event(part)) == old_readout_line(5, event(part))


def test_non_finite_values_keep_the_general_path() -> None:
    part = np.array([[np.nan, 1.0], [np.inf, -np.inf]], np.float32)
    assert values_json(part) is None  # the caller's general path refuses it, as before
    assert readout_line(0, event(part)) == old_readout_line(0, event(part))  # Evergreen prints null


# -- the real default model, over both wires ----------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Iterator[LiveServer]:
    from prismgate.settings import Settings

    settings = Settings.load(
        {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "threads": 1, "shutdown_grace_s": 2.0}, env={}
    )
    with run_server(settings) as server:
        yield server


ASK = {
    "max_tokens": 12,
    "temperature": 0,
    "stream": True,
    "messages": [{"role": "user", "content": "Say something about the sea, in French."}],
}


def sse(server: LiveServer, readouts: Any) -> list[str]:
    """The raw ``data:`` payloads of a streamed chat answer."""
    body = {"model": server.service.pool.default_model, **ASK, "readouts": readouts}
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def entries(payloads: list[str]) -> list[dict[str, Any]]:
    chunks = [json.loads(p) for p in payloads]
    return [e for c in chunks if c["choices"] for e in (c["choices"][0].get("prismgate") or {}).get("readouts", [])]


def decode(value: str, dtype: str, shape: tuple[int, int]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(value), dtype=dtype).reshape(shape)


@pytest.mark.slow
def test_openai_base64_is_the_engines_float32_and_text_bytes_are_unchanged(smollm2: LiveServer) -> None:
    text_payloads = sse(smollm2, True)
    b32_payloads = sse(smollm2, {"encoding_format": "base64"})
    f16 = entries(sse(smollm2, {"encoding_format": "base64", "dtype": "float16"}))
    text, b32 = entries(text_payloads), entries(b32_payloads)
    axes = json.loads(b32_payloads[0])["prismgate"]["readouts"]
    assert axes["encoding_format"] == "base64" and axes["dtype"] == "float32"
    assert "encoding_format" not in json.loads(text_payloads[0])["prismgate"]["readouts"]  # text: as before
    shape = (len(axes["layers"]), len(axes["concepts"]))
    assert len(text) == len(b32) == len(f16) > 5
    raw = [p for p in text_payloads if '"values":' in p]
    for t, b, h in zip(text, b32, f16, strict=True):
        assert (t["position"], t["id"], t["token"]) == (b["position"], b["id"], b["token"])
        exact = decode(b["values"], "<f4", shape)
        assert np.array_equal(exact, np.array(t["values"], np.float32))  # the float32 the text rounds from
        assert [[float(str(v)) for v in row] for row in exact] == t["values"]
        assert np.array_equal(decode(h["values"], "<f2", shape), exact.astype(np.float16))  # fp16 rounding
        # the wire's text, byte for byte, is what the old encoder printed for these values
        assert any('"values":' + old_values_json(exact) + "}" in p for p in raw)


@pytest.mark.slow
async def test_evergreen_base64_is_the_engines_float32_and_text_bytes_are_unchanged(smollm2: LiveServer) -> None:
    async def lines(config: dict[str, Any]) -> list[bytes]:
        async with websockets.connect(smollm2.ws_url + "/evergreen", max_size=None) as ws:
            action = generate("p", "r", config={"maxTokens": 10, **config}, extra_outputs={"readouts": "ro"})
            await ws.send(msg(actions=[action], fragments=[text_leaf("p", "Say something about the sea.")]))
            return (await Collector(ws).until_complete("ro"))["ro"].data.splitlines(keepends=True)

    text = await lines({})
    b32 = await lines({"readoutEncodingFormat": "base64"})
    f16 = await lines({"readoutEncodingFormat": "base64", "readoutDtype": "float16"})
    header = json.loads(b32[0])
    assert header["encodingFormat"] == "base64" and header["dtype"] == "float32"
    assert "encodingFormat" not in json.loads(text[0])
    shape = (len(header["layers"]), len(header["concepts"]))
    assert len(text) == len(b32) == len(f16) == 11
    for t_line, b_line, h_line in zip(text[1:], b32[1:], f16[1:], strict=True):
        t, b, h = json.loads(t_line), json.loads(b_line), json.loads(h_line)
        exact = decode(b["values"], "<f4", shape)
        assert t["values"] == [[number(v) for v in row] for row in exact.tolist()]  # 6 digits of these float32
        assert np.array_equal(decode(h["values"], "<f2", shape), exact.astype(np.float16))
        same = TokenEvent(id=t["tokenId"], position=t["position"], is_prefill=False, readout=exact, text=t["text"])
        assert t_line == old_readout_line(t["index"], same) == readout_line(t["index"], same)


# -- refused values name their field --------------------------------------------------------------


@pytest.mark.parametrize(
    ("readouts", "param", "says"),
    [
        ({"encoding_format": "base85"}, "readouts.encoding_format", "'float' or 'base64', got 'base85'"),
        ({"encoding_format": 64}, "readouts.encoding_format", "got 64"),
        ({"encoding_format": "base64", "dtype": "float64"}, "readouts.dtype", "'float32' or 'float16'"),
        ({"dtype": "float16"}, "readouts.dtype", "applies only with 'readouts.encoding_format': 'base64'"),
        ({"encoding": "base64"}, "readouts", "unknown keys ['encoding']"),
    ],
)
def test_bad_openai_encodings_are_400_naming_the_field(
    live_server: LiveServer, readouts: dict[str, Any], param: str, says: str
) -> None:
    body = {
        "model": live_server.service.pool.default_model,
        "prompt": "Hi",
        "max_tokens": 2,
        "readouts": readouts,
    }
    r = httpx.post(live_server.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and param in error["message"]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"readoutEncodingFormat": "hex"}, "config.readout_encoding_format' must be 'float' or 'base64', got 'hex'"),
        ({"readoutEncodingFormat": "base64", "readoutDtype": "bf16"}, "config.readout_dtype' must be 'float32'"),
        ({"readoutDtype": "float16"}, "config.readout_dtype' applies only with"),
    ],
)
async def test_bad_evergreen_encodings_abort_naming_the_field(
    live_server: LiveServer, config: dict[str, Any], says: str
) -> None:
    async with websockets.connect(live_server.ws_url + "/evergreen", max_size=None) as ws:
        action = generate("p", "r", config={"maxTokens": 2, **config}, extra_outputs={"readouts": "ro"})
        await ws.send(msg(actions=[action], fragments=[text_leaf("p", "Hi")]))
        code, reason = await closed_with(ws)
    assert code == 4400 and says in reason


async def evergreen_logprob_lines(server: LiveServer, config: dict[str, Any]) -> list[dict[str, Any]]:
    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        action = generate(
            "p", "r", config={"maxTokens": 6, "topLogprobs": 3, **config}, extra_outputs={"logprobs": "lp"}
        )
        await ws.send(msg(actions=[action], fragments=[text_leaf("p", "Name three colours.")]))
        data = (await Collector(ws).until_complete("lp"))["lp"].data
    return [json.loads(x) for x in data.splitlines()]


async def test_evergreen_base64_logprobs_are_the_text_logprobs(live_server: LiveServer) -> None:
    text = await evergreen_logprob_lines(live_server, {})
    b32 = await evergreen_logprob_lines(live_server, {"logprobsEncodingFormat": "base64"})
    f16 = await evergreen_logprob_lines(
        live_server, {"logprobs_encoding_format": "base64", "logprobs_dtype": "float16"}
    )
    assert len(text) == len(b32) == len(f16) == 6
    for t, b, h in zip(text, b32, f16, strict=True):
        assert set(t) == {"index", "position", "tokenId", "text", "logprob", "top"}  # unchanged for old clients
        assert set(b) == {"index", "position", "tokenId", "text", "logprob", "topIds", "topLogprobs"}
        assert {k: t[k] for k in ("index", "position", "tokenId", "text", "logprob")} == {
            k: b[k] for k in ("index", "position", "tokenId", "text", "logprob")
        }
        ids = np.frombuffer(base64.b64decode(b["topIds"]), "<i4")
        assert ids.tolist() == [alt["tokenId"] for alt in t["top"]] and len(ids) == 3
        exact = np.frombuffer(base64.b64decode(b["topLogprobs"]), "<f4")
        assert [alt["logprob"] for alt in t["top"]] == [number(v) for v in exact.tolist()]  # text: 6 digits of these
        assert np.array_equal(np.frombuffer(base64.b64decode(h["topLogprobs"]), "<f2"), exact.astype(np.float16))


@pytest.mark.parametrize(
    ("config", "outputs", "says"),
    [
        ({"logprobsEncodingFormat": "hex"}, {"logprobs": "lp"}, "config.logprobs_encoding_format' must be 'float'"),
        ({"logprobsDtype": "float16"}, {"logprobs": "lp"}, "config.logprobs_dtype' applies only with"),
        ({"logprobsEncodingFormat": "base64"}, {}, "needs a 'logprobs' output"),
    ],
)
async def test_bad_evergreen_logprob_encodings_abort_naming_the_field(
    live_server: LiveServer, config: dict[str, Any], outputs: dict[str, str], says: str
) -> None:
    async with websockets.connect(live_server.ws_url + "/evergreen", max_size=None) as ws:
        action = generate("p", "r", config={"maxTokens": 2, **config}, extra_outputs=outputs)
        await ws.send(msg(actions=[action], fragments=[text_leaf("p", "Hi")]))
        code, reason = await closed_with(ws)
    assert code == 4400 and says in reason


def test_tiny_model_base64_completions_decode_to_the_text_values(live_server: LiveServer) -> None:
    """Non-streamed completions with echo: prompt and answer readouts, both forms, the same float32."""

    def ask(readouts: Any) -> dict[str, Any]:
        body = {
            "model": live_server.service.pool.default_model,
            "prompt": "Hello there",
            "max_tokens": 4,
            "temperature": 0,
            "echo": True,
            "readouts": readouts,
        }
        r = httpx.post(live_server.http_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    text, b32 = ask(True), ask({"encoding_format": "base64", "dtype": "float32"})
    axes = b32["prismgate"]["readouts"]
    shape = (len(axes["layers"]), len(axes["concepts"]))
    t_entries, b_entries = text["choices"][0]["prismgate"]["readouts"], b32["choices"][0]["prismgate"]["readouts"]
    assert len(t_entries) == len(b_entries) > 4  # the echoed prompt's tokens too
    for t, b in zip(t_entries, b_entries, strict=True):
        assert np.array_equal(decode(b["values"], "<f4", shape), np.array(t["values"], np.float32))


# -- logprobs as base64 (OpenAI) -------------------------------------------------------------------


def chat_chunks(server: LiveServer, **extra: Any) -> list[dict[str, Any]]:
    body = {
        "model": server.service.pool.default_model,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 3,
        **extra,
    }
    with httpx.stream("POST", server.http_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]


def test_base64_logprobs_are_the_text_logprobs(live_server: LiveServer) -> None:
    text = chat_chunks(live_server)
    b32 = chat_chunks(live_server, logprobs_encoding_format="base64", readouts=True)
    f16 = chat_chunks(live_server, logprobs_encoding_format="base64", logprobs_dtype="float16")
    head = b32[0]["prismgate"]["logprobs"]
    assert head == {"encoding_format": "base64", "dtype": "float32", "top_logprobs": 3}
    assert "prismgate" not in text[0]  # nothing new for a client that asks nothing new

    def listed(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]

    def joined(chunks: list[dict[str, Any]], key: str, dtype: str) -> np.ndarray:
        return np.concatenate(
            [np.frombuffer(base64.b64decode(c["prismgate"]["logprobs"][key]), dtype) for c in listed(chunks)]
        )

    content = [e for c in listed(text) for e in c["logprobs"]["content"]]
    assert all(c["logprobs"] is None for c in listed(b32))  # the OpenAI form is replaced, not repeated
    want = np.array([e["logprob"] for e in content])
    want_top = np.array([[t["logprob"] for t in e["top_logprobs"]] for e in content])
    assert np.array_equal(joined(b32, "logprobs", "<f4"), want.astype(np.float32))
    assert np.array_equal(joined(b32, "top_logprobs", "<f4").reshape(-1, 3), want_top.astype(np.float32))
    assert np.array_equal(joined(f16, "logprobs", "<f2"), want.astype(np.float16))
    ids = joined(b32, "ids", "<i4")
    readout_ids = [e["id"] for c in listed(b32) for e in c["prismgate"]["readouts"]]
    assert ids.tolist() == readout_ids and len(ids) == len(content) > 3
    assert joined(b32, "top_ids", "<i4").reshape(-1, 3)[:, 0].tolist() == ids.tolist()  # greedy: the best one


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"logprobs_encoding_format": "b64"}, "logprobs_encoding_format", "'float' or 'base64', got 'b64'"),
        ({"logprobs_encoding_format": "base64", "logprobs_dtype": 16}, "logprobs_dtype", "'float32' or 'float16'"),
        ({"logprobs_dtype": "float16"}, "logprobs_dtype", "applies only with 'logprobs_encoding_format'"),
        (
            {"logprobs": False, "top_logprobs": 0, "logprobs_encoding_format": "base64"},
            "logprobs_encoding_format",
            "needs logprobs",
        ),
    ],
)
def test_bad_logprob_encodings_are_400_naming_the_field(
    live_server: LiveServer, extra: dict[str, Any], param: str, says: str
) -> None:
    body = {
        "model": live_server.service.pool.default_model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "logprobs": True,
        **extra,
    }
    r = httpx.post(live_server.http_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_base64_completion_logprobs_with_echo_mark_the_first_prompt_token_nan(live_server: LiveServer) -> None:
    def ask(**extra: Any) -> dict[str, Any]:
        body = {
            "model": live_server.service.pool.default_model,
            "prompt": "Hello there",
            "max_tokens": 3,
            "temperature": 0,
            "echo": True,
            "logprobs": 2,
            **extra,
        }
        r = httpx.post(live_server.http_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    text, b32 = ask(), ask(logprobs_encoding_format="base64")
    assert b32["logprobs"] is None
    got = np.frombuffer(base64.b64decode(b32["prismgate"]["logprobs"]["logprobs"]), "<f4")
    want = text["logprobs"]["token_logprobs"]
    assert want[0] is None and np.isnan(got[0]) and len(got) == len(want) > 3
    assert np.array_equal(got[1:], np.array(want[1:], np.float32))
    top = np.frombuffer(base64.b64decode(b32["prismgate"]["logprobs"]["top_logprobs"]), "<f4").reshape(-1, 2)
    assert np.isnan(top[0]).all() and not np.isnan(top[1:]).any()
