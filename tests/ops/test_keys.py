"""Named keys on a real server, over real sockets on every wire: who may do what, whose sessions are whose.

One server with a keys file (tiny model, concept pack loaded): alice and bob are plain keys,
root has the admin scope, `plain` may not steer, read readouts or logprobs, or use the
playground, `elsewhere` may use only a model this server does not serve, `slow` has a
token rate and `single` one generation at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import websockets

from prismgate.core.errors import Code
from prismgate.keys import entry_toml
from prismgate.schemas import salience_pb2 as pb
from prismgate.schemas import salience_steering_pb2 as steer_pb
from prismgate.schemas import salience_steering_pb2_grpc
from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.evergreen.wire import Collector, generate, msg, text_leaf
from tests.graphpipe.helpers import infer_buffer, read_response
from tests.ops.helpers import scrape, value
from tests.salience.conftest import Client, connect, rpc_error

KEYS: dict[str, tuple[str, dict[str, Any]]] = {
    "alice": ("k-alice-0123456789abcdef", {}),
    "bob": ("k-bob-0123456789abcdef", {}),
    "root": ("k-root-0123456789abcdef", {"admin": True}),
    "plain": ("k-plain-0123456789abcdef", {"steer": False, "readouts": False, "logprobs": False, "playground": False}),
    "elsewhere": ("k-elsewhere-0123456789abcdef", {"models": ["another-model"]}),
    "slow": ("k-slow-0123456789abcdef", {"tokens_per_minute": 20}),
    "single": ("k-single-0123456789abcdef", {"max_concurrent": 1}),
}


def write_keys(path: Path, names: list[str], extra: dict[str, tuple[str, dict[str, Any]]] | None = None) -> None:
    keys = {name: KEYS[name] for name in names} | (extra or {})
    path.write_text("\n".join(entry_toml(name, key, options) for name, (key, options) in keys.items()))


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name][0]}"}


def meta(name: str) -> list[tuple[str, str]]:
    return list(auth(name).items())


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    write_keys(path, list(KEYS))
    return path


@pytest.fixture(scope="module")
def server(server_factory: Any, keys_file: Path) -> Iterator[LiveServer]:
    with server_factory(keys_file=str(keys_file)) as running:
        yield running


@pytest.fixture
def grpc_client(server: LiveServer) -> Iterator[Client]:
    client = connect(server.grpc_target)
    yield client
    client.channel.close()


def chat(server: LiveServer, name: str, **body: Any) -> httpx.Response:
    request = {"model": TINY_MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], **body}
    return httpx.post(f"{server.http_url}/v1/chat/completions", json=request, headers=auth(name), timeout=60)


# -- authentication --------------------------------------------------------------------------------


def test_every_wire_refuses_an_unknown_key_and_accepts_a_named_one(server: LiveServer, grpc_client: Client) -> None:
    assert chat(server, "alice").status_code == 200
    wrong = {"authorization": "Bearer k-nobody"}
    answer = httpx.post(f"{server.http_url}/v1/completions", json={"prompt": "x"}, headers=wrong)
    assert answer.status_code == 401
    assert httpx.get(f"{server.http_url}/graphpipe", headers=wrong).status_code == 401  # its metadata
    error = rpc_error(grpc_client.open, metadata=[("authorization", "Bearer k-nobody")])
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert grpc_client.open(metadata=meta("alice"))


async def test_the_websocket_takes_a_named_key_as_a_subprotocol(server: LiveServer) -> None:
    key = KEYS["alice"][0]
    async with websockets.connect(server.ws_url + "/evergreen", subprotocols=[f"bearer.{key}"]) as ws:
        await ws.send(msg(actions=[generate("p", "r", config={"maxTokens": 1})], fragments=[text_leaf("p", "a")]))
        assert (await Collector(ws).until_complete("r"))["r"].complete
    async with websockets.connect(server.ws_url + "/evergreen", subprotocols=["bearer.k-nobody"]) as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401


# -- sessions belong to their key ------------------------------------------------------------------


def test_another_keys_session_does_not_exist_on_salience_and_its_companions(grpc_client: Client) -> None:
    sid = grpc_client.open(metadata=meta("alice"))
    grpc_client.generate(session_id=sid, append_tokens=[5, 6, 7], max_tokens=2, top_k=1, metadata=meta("alice"))
    stranger = meta("bob")
    steering = salience_steering_pb2_grpc.SteeringStub(grpc_client.channel)
    refused = [
        rpc_error(grpc_client.dump, sid, metadata=stranger),
        rpc_error(
            grpc_client.salience.ForkSession, pb.ForkSessionRequest(session_id=sid, at_position=1), metadata=stranger
        ),
        rpc_error(grpc_client.generate, session_id=sid, append_tokens=[1], max_tokens=1, metadata=stranger),
        rpc_error(steering.GetSteering, steer_pb.GetSteeringRequest(session_id=sid), metadata=stranger),
        rpc_error(steering.SetSteering, steer_pb.SetSteeringRequest(session_id=sid), metadata=stranger),
    ]
    unknown = rpc_error(grpc_client.dump, "0" * 32, metadata=stranger)
    for error in refused:
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
        # the same words as for an id that never existed: nothing tells the two apart
        assert error.details().replace(sid, "ID") == unknown.details().replace("0" * 32, "ID")
    grpc_client.salience.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=stranger)
    assert len(grpc_client.dump(sid, metadata=meta("alice"))) == 5  # bob's close left it alone
    # the admin scope reads and closes any key's session
    assert len(grpc_client.dump(sid, metadata=meta("root"))) == 5
    grpc_client.salience.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=meta("root"))
    assert rpc_error(grpc_client.dump, sid, metadata=meta("alice")).code() == grpc.StatusCode.NOT_FOUND


def test_a_fork_belongs_to_the_key_that_forked(grpc_client: Client) -> None:
    sid = grpc_client.open(metadata=meta("alice"))
    grpc_client.generate(session_id=sid, append_tokens=[5, 6, 7], max_tokens=1, metadata=meta("alice"))
    fork = pb.ForkSessionRequest(session_id=sid, at_position=2)
    child = grpc_client.salience.ForkSession(fork, metadata=meta("root")).session_id
    assert grpc_client.dump(child, metadata=meta("root")) == [5, 6]
    assert rpc_error(grpc_client.dump, child, metadata=meta("alice")).code() == grpc.StatusCode.NOT_FOUND


def test_another_keys_session_does_not_exist_on_the_openai_api(server: LiveServer) -> None:
    base = server.http_url
    sid = httpx.post(f"{base}/v1/sessions", json={}, headers=auth("alice")).json()["id"]
    assert chat(server, "alice", session_id=sid).status_code == 200
    for response in (
        httpx.get(f"{base}/v1/sessions/{sid}", headers=auth("bob")),
        chat(server, "bob", session_id=sid),
        httpx.delete(f"{base}/v1/sessions/{sid}", headers=auth("bob")),
    ):
        assert response.status_code == 404, response.text
    assert httpx.get(f"{base}/v1/sessions/{sid}", headers=auth("alice")).json()["length"] > 0
    # only the admin scope lists every session, with its owner
    assert httpx.get(f"{base}/v1/sessions", headers=auth("alice")).status_code == 403
    listed = httpx.get(f"{base}/v1/sessions", headers=auth("root")).json()["data"]
    assert {"id": sid, "object": "session", "owner": "alice"} in listed
    assert httpx.delete(f"{base}/v1/sessions/{sid}", headers=auth("root")).status_code == 200
    assert httpx.get(f"{base}/v1/sessions/{sid}", headers=auth("alice")).status_code == 404


# -- permissions -----------------------------------------------------------------------------------


def test_a_key_without_a_permission_is_refused_permission_denied(server: LiveServer, grpc_client: Client) -> None:
    steer = [{"concept": "concept1", "layer": 0, "scale": 4}]
    for body in ({"steering": steer}, {"readouts": True}, {"logprobs": True, "top_logprobs": 2}):
        answer = chat(server, "plain", **body)
        assert answer.status_code == 403, (body, answer.text)
        assert answer.json()["error"]["code"] == "permission_denied"
        assert chat(server, "alice", **body).status_code == 200
    manifest = httpx.get(f"{server.http_url}/playground/manifest.json", headers=auth("plain"))
    assert manifest.status_code == 403
    assert httpx.get(f"{server.http_url}/playground/manifest.json", headers=auth("alice")).status_code == 200
    sid = grpc_client.open(metadata=meta("plain"))
    readouts = [pb.PositionRange(start=0, end=4)]
    error = rpc_error(
        grpc_client.generate, session_id=sid, append_tokens=[5], max_tokens=1, readout_ranges=readouts,
        metadata=meta("plain"),
    )  # fmt: skip
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "readouts" in error.details()
    steering = salience_steering_pb2_grpc.SteeringStub(grpc_client.channel)
    entry = steer_pb.SteeringEntry(concept="concept1", layer=0, scale=4)
    request = steer_pb.SetSteeringRequest(session_id=sid, entries=[entry])
    error = rpc_error(steering.SetSteering, request, metadata=meta("plain"))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_key_limited_to_other_models_is_refused_on_every_wire(server: LiveServer, grpc_client: Client) -> None:
    assert chat(server, "elsewhere").status_code == 403
    assert rpc_error(grpc_client.open, metadata=meta("elsewhere")).code() == grpc.StatusCode.PERMISSION_DENIED
    key = KEYS["elsewhere"][0]
    async with websockets.connect(server.ws_url + "/evergreen", subprotocols=[f"bearer.{key}"]) as ws:
        await ws.send(msg(actions=[generate("p", "r", config={"maxTokens": 1})], fragments=[text_leaf("p", "a")]))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4403


# -- limits ----------------------------------------------------------------------------------------


def test_a_key_over_its_token_rate_gets_429_with_retry_after_and_resource_exhausted(
    server: LiveServer, grpc_client: Client
) -> None:
    first = chat(server, "slow", max_tokens=4)  # the tiny model's chat prompt alone is over 20 tokens
    assert first.status_code == 200
    again = chat(server, "slow")
    if again.status_code == 200:  # the minute turned between the two: this one used up the new window
        again = chat(server, "slow")
    assert again.status_code == 429, again.text
    assert 1 <= int(again.headers["retry-after"]) <= 60
    assert "tokens_per_minute" in again.json()["error"]["message"]
    sid = grpc_client.open(metadata=meta("slow"))
    call = grpc_client.salience.Generate(
        pb.GenerateRequest(session_id=sid, append_tokens=[5], max_tokens=1), metadata=meta("slow"), timeout=30
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(call)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(caught.value.trailing_metadata() or ())
    assert 1 <= int(trailers["retry-after"]) <= 60
    assert chat(server, "alice").status_code == 200  # another key is not held back


def test_a_key_at_its_concurrency_limit_is_refused_on_graphpipe_with_retry_after(server: LiveServer) -> None:
    """Each GraphPipe row is a generation: two rows at once are one more than ``single`` may run."""
    url = f"{server.http_url}/graphpipe"

    def infer(rows: list[str]) -> httpx.Response:
        body = infer_buffer([np.array(rows)], ["prompt"], ["lengths"], '{"max_tokens": 4}')
        return httpx.post(url, content=body, headers=auth("single"), timeout=60)

    refused = infer(["hi", "there"])
    outputs, errors = read_response(refused.content)
    assert refused.status_code == 200 and refused.headers["retry-after"] == "1"  # GraphPipe's error form is a 200
    assert errors and errors[0]["code"] == Code.RESOURCE_EXHAUSTED and b"max_concurrent" in errors[0]["message"]
    answered = infer(["hi"])  # the refused batch's lease is free again
    outputs, errors = read_response(answered.content)
    assert errors == [] and outputs[0].tolist() == [4]


# -- metrics and logs ------------------------------------------------------------------------------


def test_requests_tokens_and_refusals_are_counted_per_key(server: LiveServer) -> None:
    before = scrape(server.http_url)
    # ignore_eos: a sampled answer of the random tiny model may otherwise end early, at EOS
    assert chat(server, "bob", max_tokens=3, ignore_eos=True).status_code == 200
    assert chat(server, "plain", readouts=True).status_code == 403
    httpx.post(f"{server.http_url}/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer nope"})
    after = scrape(server.http_url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("prismgate_key_requests_total", key="bob") == 1
    assert grew("prismgate_key_tokens_total", key="bob", kind="completion") == 3
    assert grew("prismgate_key_tokens_total", key="bob", kind="prompt") > 0
    assert grew("prismgate_key_refusals_total", key="plain", code="PERMISSION_DENIED") == 1
    assert grew("prismgate_key_refusals_total", key="", code="UNAUTHENTICATED") == 1
    names = {dict(labels).get("key") for (sample, labels), _ in after.items() if sample.startswith("prismgate_key_")}
    assert names <= set(KEYS) | {""}  # only configured names become label values


def test_the_generation_log_line_names_the_key_and_never_the_key_itself(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="prismgate.generation"):
        assert chat(server, "bob").status_code == 200
    lines = [r for r in caplog.records if r.getMessage() == "generation finished"]
    assert lines and getattr(lines[-1], "key", None) == "bob"
    with caplog.at_level(logging.INFO, logger="prismgate.generation"):
        client = connect(server.grpc_target)
        with contextlib.closing(client.channel):
            assert rpc_error(client.open, metadata=meta("elsewhere")).code() == grpc.StatusCode.PERMISSION_DENIED
    refused = [r for r in caplog.records if r.getMessage() == "request refused"]
    assert refused and getattr(refused[-1], "key", None) == "elsewhere"
    assert getattr(refused[-1], "code", None) == "PERMISSION_DENIED"
    for name in ("bob", "elsewhere"):
        assert all(KEYS[name][0] not in json.dumps(r.__dict__, default=str) for r in caplog.records)


# -- the keys file, changed while the server runs --------------------------------------------------


def test_a_key_added_and_one_revoked_by_rewriting_the_file(server_factory: Any, tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    write_keys(path, ["alice", "bob"])
    with server_factory(keys_file=str(path)) as running:
        assert chat(running, "bob").status_code == 200
        carol = {"carol": ("k-carol-0123456789abcdef", {})}
        write_keys(path, ["alice"], carol)
        headers = {"authorization": "Bearer k-carol-0123456789abcdef"}
        body = {"model": TINY_MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        deadline = time.monotonic() + 10  # the file is checked at most once a second
        while chat(running, "bob").status_code != 401:
            assert time.monotonic() < deadline, "bob's key still works after it left the file"
            time.sleep(0.2)
        answer = httpx.post(f"{running.http_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200
        client = connect(running.grpc_target)
        with contextlib.closing(client.channel):
            assert rpc_error(client.open, metadata=meta("bob")).code() == grpc.StatusCode.UNAUTHENTICATED
            assert client.open(metadata=list(headers.items()))
        # a file that no longer parses keeps the keys loaded before
        path.write_text("[keys.alice]\nsha256 = 'not a digest'\n")
        time.sleep(1.2)
        assert chat(running, "alice").status_code == 200
