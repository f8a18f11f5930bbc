"""The HTTP edge on a real server: auth in each wire's form, and every refused request counted once."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from prismgate.core.errors import Code, GatewayError
from tests.evergreen.wire import generate, msg, text_leaf
from tests.graphpipe.helpers import infer_buffer, read_response
from tests.ops.helpers import scrape, value

ERRORS = "prismgate_request_errors_total"
GO_CLIENT = {"User-Agent": "Go-http-client/1.1"}  # GraphPipe answers Go clients with HTTP statuses


@pytest.fixture(scope="module")
def guarded(server_factory: Any) -> Iterator[Any]:
    with server_factory(auth_token="s3cret") as server:
        yield server


def errors(server: Any, protocol: str, code: Code) -> float:
    return value(scrape(server.http_url), ERRORS, protocol=protocol, code=code.name)


def evergreen_close(server: Any, **options: Any) -> tuple[int, str]:
    with connect(server.ws_url + "/evergreen", **options) as ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=10)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason


def test_each_wire_refuses_a_missing_token_its_own_way_and_counts_it(guarded: Any) -> None:
    base = guarded.http_url
    before = {p: errors(guarded, p, Code.UNAUTHENTICATED) for p in ("openai", "graphpipe", "evergreen", "http")}

    r = httpx.get(base + "/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"

    body = infer_buffer([np.array(["x"])], [], ["lengths"], '{"max_tokens": 1}')
    outputs, errs = read_response(httpx.post(base + "/", content=body).content)  # the Python client's form
    assert outputs == [] and errs[0]["code"] == Code.UNAUTHENTICATED
    assert httpx.post(base + "/graphpipe", content=body, headers=GO_CLIENT).status_code == 401
    assert httpx.get(base + "/graphpipe").status_code == 401

    code, reason = evergreen_close(guarded)
    assert code == 4401 and reason.startswith("UNAUTHENTICATED")

    r = httpx.get(base + "/playground/manifest.json")
    assert r.status_code == 401 and r.headers["content-type"].startswith("text/plain")

    after = {p: errors(guarded, p, Code.UNAUTHENTICATED) for p in before}
    assert {p: after[p] - before[p] for p in before} == {"openai": 1, "graphpipe": 3, "evergreen": 1, "http": 1}


def test_probes_and_the_playground_page_stay_open(guarded: Any) -> None:
    base = guarded.http_url
    for path in ("/healthz", "/readyz", "/metrics", "/playground", "/graphpipe/control/is_ready", "/control/is_alive"):
        assert httpx.get(base + path).status_code == 200, path


def test_parse_and_validation_refusals_are_counted_once(guarded: Any) -> None:
    base = guarded.http_url
    auth = {"Authorization": "Bearer s3cret"}
    before_invalid = {p: errors(guarded, p, Code.INVALID_ARGUMENT) for p in ("openai", "graphpipe")}
    before_missing = errors(guarded, "openai", Code.NOT_FOUND)

    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(base + "/v1/chat/completions", json={"model": "no-such-model", "messages": messages}, headers=auth)
    assert r.status_code == 404
    r = httpx.post(base + "/graphpipe", content=b"\x00garbage", headers={**auth, **GO_CLIENT})
    assert r.status_code == 400
    # other GraphPipe clients get the error inside a 200 flatbuffer: counted all the same
    r = httpx.post(base + "/graphpipe", content=b"\x00garbage", headers=auth)
    assert r.status_code == 200 and r.content

    assert errors(guarded, "openai", Code.INVALID_ARGUMENT) - before_invalid["openai"] == 1
    assert errors(guarded, "openai", Code.NOT_FOUND) - before_missing == 1
    assert errors(guarded, "graphpipe", Code.INVALID_ARGUMENT) - before_invalid["graphpipe"] == 2


def test_an_answered_request_counts_no_error(guarded: Any) -> None:
    before = scrape(guarded.http_url)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(guarded.http_url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200
    after = scrape(guarded.http_url)
    changed = {k for k in after if k[0] == ERRORS and after[k] != before.get(k, 0.0)}
    assert changed == set()


@pytest.mark.parametrize("offered", [["evergreen", "bearer.s3cret"], ["bearer.s3cret"]])
def test_the_token_as_a_websocket_subprotocol(guarded: Any, offered: list[str]) -> None:
    """Browsers cannot set headers on a WebSocket: the token rides in the subprotocol list, not the URL."""
    with connect(guarded.ws_url + "/evergreen", subprotocols=offered) as ws:  # type: ignore[arg-type]
        assert ws.subprotocol == offered[0]
        ws.send(msg(actions=[generate("p", "r", config={"maxTokens": 1})], fragments=[text_leaf("p", "hi")]))
        reply = json.loads(ws.recv(timeout=30))
        assert reply["nodeFragments"][0]["id"] == "r"
    code, _ = evergreen_close(guarded, subprotocols=["evergreen", "bearer.wrong"])  # type: ignore[arg-type]
    assert code == 4401


def test_errors_a_route_raises_take_the_one_error_path(server_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A GatewayError out of a route is answered in its wire's form; anything else is a counted 500, logged once."""

    async def not_there(_request: Request) -> Response:
        raise GatewayError(Code.NOT_FOUND, "no such thing")

    async def broken(_request: Request) -> Response:
        raise RuntimeError("a bug")

    with server_factory() as server:
        routes = server.gateway.app.router.routes
        routes[:0] = [Route("/v1/raises", not_there), Route("/v1/bug", broken), Route("/bug", broken)]
        before = {(p, c): errors(server, p, c) for p in ("openai", "http") for c in (Code.NOT_FOUND, Code.INTERNAL)}

        r = httpx.get(server.http_url + "/v1/raises")
        assert r.status_code == 404 and r.json()["error"]["message"] == "no such thing"
        with caplog.at_level(logging.ERROR, logger="prismgate.edge.refusals"):
            r = httpx.get(server.http_url + "/v1/bug")
            assert r.status_code == 500 and "RuntimeError: a bug" in r.json()["error"]["message"]
            r = httpx.get(server.http_url + "/bug")
            assert r.status_code == 500 and r.headers["content-type"].startswith("text/plain")
        assert [rec.getMessage() for rec in caplog.records if rec.name == "prismgate.edge.refusals"] == [
            "unhandled error on GET /v1/bug",
            "unhandled error on GET /bug",
        ]
        after = {key: errors(server, *key) for key in before}
    assert {key: after[key] - before[key] for key in before} == {
        ("openai", Code.NOT_FOUND): 1,
        ("openai", Code.INTERNAL): 1,
        ("http", Code.NOT_FOUND): 0,
        ("http", Code.INTERNAL): 1,
    }
