"""GraphPipe over real sockets: the reference Python client, raw HTTP, the status policy, limits."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests
from graphpipe import remote

from prismgate.codecs.graphpipe.outputs import OUTPUTS
from prismgate.core.errors import Code
from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp
from tests.graphpipe.helpers import infer_buffer, metadata_buffer, read_response, read_tensor_fields

GREEDY_4 = '{"max_tokens": 4}'


@pytest.fixture(scope="module")
def url(live_server: Any) -> str:
    return str(live_server.http_url)


def raw_exchange(base: str, path: str, body: bytes, headers: dict[str, str], *, expect: bool) -> tuple[bytes, bytes]:
    """POST over a bare socket; with ``expect`` wait for ``100 Continue`` before the body.

    Returns (the interim ``100 Continue`` or b"", the final response head + body).
    """
    parts = urlsplit(base)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        head = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}", "Connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        if expect:
            head.append("Expect: 100-continue")
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        interim = b""
        if expect:
            first = sock.recv(4096)
            if not first.startswith(b"HTTP/1.1 100"):  # answered without asking for the body
                return b"", first + _read_all(sock)
            interim = first
        sock.sendall(body)
        return interim, _read_all(sock)


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def split_http(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():  # de-chunk
        out, rest = b"", body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    return status, body


# -- the reference client ----------------------------------------------------------------


def test_execute_with_the_defaults_on_root_and_on_the_path(url: str) -> None:
    for endpoint in (url, url + "/", url + "/graphpipe"):
        text = remote.execute(endpoint, np.array(["hello", "how are you?"]))
        assert isinstance(text, np.ndarray) and text.shape == (2,) and text.dtype.kind == "S"


def test_execute_multi_with_names_and_config(url: str, live_server: Any) -> None:
    names = ["tokens", "lengths", "logprobs", "top_logprob_ids", "top_logprobs", "readouts", "text"]
    config = '{"max_tokens": 5, "logprobs": 3, "readout_layers": [1]}'
    tokens, lengths, logprobs, top_ids, top_lp, readouts, text = remote.execute_multi(
        url, [np.array(["first prompt", "second"])], ["prompt"], names, config
    )
    manifest = live_server.service.info().readouts
    m = int(lengths.max())
    assert lengths.dtype == np.int32 and lengths.shape == (2,) and 1 <= m <= 5
    assert tokens.dtype == np.int32 and tokens.shape == (2, m)
    assert logprobs.dtype == np.float32 and logprobs.shape == (2, m)
    assert top_ids.shape == top_lp.shape == (2, m, 3)
    assert readouts.dtype == np.float32 and readouts.shape == (2, m, 1, len(manifest.concepts))
    for row in range(2):
        n = int(lengths[row])
        assert (tokens[row, :n] >= 0).all() and (tokens[row, n:] == -1).all()
        assert np.isfinite(logprobs[row, :n]).all() and (logprobs[row, :n] <= 0).all()
        # greedy: the chosen token is the top alternative, with the same logprob
        assert (top_ids[row, :n, 0] == tokens[row, :n]).all()
        np.testing.assert_allclose(top_lp[row, :n, 0], logprobs[row, :n], rtol=1e-5)
        assert np.isfinite(readouts[row, :n]).all()
    assert text.shape == (2,)


def test_batch_rows_match_single_row_runs(url: str) -> None:
    prompts = ["alpha", "a longer second prompt", "third!"]
    batch = remote.execute_multi(url, [np.array(prompts)], ["prompt"], ["tokens", "lengths"], GREEDY_4)
    for i, prompt in enumerate(prompts):
        one = remote.execute_multi(url, [np.array([prompt])], ["prompt"], ["tokens", "lengths"], GREEDY_4)
        n = int(one[1][0])
        assert int(batch[1][i]) == n
        assert batch[0][i, :n].tolist() == one[0][0, :n].tolist()


def test_tokens_output_feeds_back_as_tokens_input(url: str) -> None:
    [tokens] = remote.execute_multi(url, [np.array([[3, 4, 5], [6, 7, -1]], dtype=np.int64)], [], ["tokens"], GREEDY_4)
    assert tokens.shape[0] == 2
    [again] = remote.execute_multi(url, [tokens.astype(np.int32)], ["tokens"], ["lengths"], '{"max_tokens": 1}')
    assert again.tolist() == [1, 1]


def test_metadata_and_the_get_helpers(url: str, live_server: Any) -> None:
    meta = remote.metadata(url)
    info = live_server.service.info()
    assert meta.Name().decode() == info.model_id and meta.Server() == b"prismgate" and meta.Version()
    assert remote.get_input_names(url) == ["prompt", "tokens"]
    assert remote.get_output_names(url) == list(OUTPUTS)
    assert remote.get_input_types(url) == [np.dtype("O"), np.dtype("int64")]
    assert remote.get_output_types(url)[:3] == [np.dtype("O"), np.dtype("int32"), np.dtype("int32")]
    assert remote.get_input_shapes(url) == [[None], [None, None]]
    assert remote.get_output_shapes(url)[-1] == [None, None, None, len(info.readouts.concepts)]


def test_get_answers_metadata_json_in_the_reference_style(url: str) -> None:
    for path in ("/graphpipe", "/graphpipe/"):
        data = requests.get(url + path, timeout=30).json()
        assert set(data) == {"Name", "Version", "Server", "Description", "Inputs", "Outputs"}
        assert data["Inputs"][0] == {
            "Name": "prompt",
            "Description": data["Inputs"][0]["Description"],
            "Shape": [-1],
            "Type": gp.Type.String,
        }
        assert [o["Name"] for o in data["Outputs"]] == list(OUTPUTS)


def test_control_routes(url: str) -> None:
    for prefix in ("", "/graphpipe"):
        for route in ("is_ready", "is_alive"):
            reply = requests.get(f"{url}{prefix}/control/{route}", timeout=30)
            assert reply.status_code == 200 and reply.text.strip() == "ok"


# -- raw HTTP ------------------------------------------------------------------------------


def test_form_content_type_and_expect_100_continue(url: str) -> None:
    body = infer_buffer([np.array(["hi"])], ["prompt"], ["lengths"], '{"max_tokens": 2}')
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    interim, final = raw_exchange(url, "/graphpipe", body, headers, expect=True)
    assert interim.startswith(b"HTTP/1.1 100")
    status, payload = split_http(final)
    outputs, errors = read_response(payload)
    assert status == 200 and errors == [] and outputs[0].tolist() == [2]


def test_every_output_tensor_writes_type_shape_and_data(url: str) -> None:
    body = infer_buffer([np.array(["hi"])], ["prompt"], ["text", "tokens", "logprobs"], '{"max_tokens": 0}')
    reply = requests.post(url, data=body, timeout=30)
    fields = read_tensor_fields(reply.content)
    assert fields == [(gp.Type.String, True, True), (gp.Type.Int32, True, True), (gp.Type.Float32, True, True)]
    outputs, _ = read_response(reply.content)
    assert outputs[1].shape == (1, 0) and outputs[2].shape == (1, 0)


# -- errors --------------------------------------------------------------------------------


def bad_requests() -> Iterator[tuple[str, bytes, str]]:
    good = infer_buffer([np.array([[1, 2, 3]], dtype=np.int64)], ["tokens"], ["lengths"], GREEDY_4)
    wrong_size = bytearray(good)
    at = good.find(np.array([1, 3], dtype="<i8").tobytes())
    wrong_size[at + 8 : at + 16] = np.array([9], dtype="<i8").tobytes()
    yield "garbage", b"definitely not a flatbuffer", "malformed GraphPipe request"
    yield "empty", b"", "too short"
    yield "truncated", good[: len(good) // 2], "malformed GraphPipe request"
    yield "wrong data size", bytes(wrong_size), "needs 72 bytes of data but the tensor has 24"
    yield "unknown input", infer_buffer([np.array(["x"])], ["image"]), "unknown input 'image'"
    yield "unknown output", infer_buffer([np.array(["x"])], None, ["logits"]), "unknown output 'logits'"
    yield (
        "bad config",
        infer_buffer([np.array(["x"])], config='{"temprature": 1}'),
        "unknown config key(s) 'temprature'",
    )
    yield "bad token id", infer_buffer([np.array([[10**9]])], ["tokens"]), "row 0: token id 1000000000"
    yield "context", infer_buffer([np.array(["x"])], config='{"max_tokens": 100000}'), "exceeds the model's context"


@pytest.mark.parametrize(("what", "body", "message"), list(bad_requests()), ids=[c[0] for c in bad_requests()])
def test_bad_requests_get_a_coded_error_and_the_server_keeps_serving(
    url: str, what: str, body: bytes, message: str
) -> None:
    reply = requests.post(url + "/graphpipe", data=body, timeout=30)
    assert reply.status_code == 200, what
    outputs, errors = read_response(reply.content)
    assert outputs == [] and len(errors) == 1
    assert message in errors[0]["message"].decode()
    assert errors[0]["code"] in {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}
    assert remote.execute_multi(url, [np.array(["still there?"])], [], ["lengths"], '{"max_tokens": 1}')[
        0
    ].tolist() == [1]


def test_the_python_client_raises_the_message(url: str) -> None:
    with pytest.raises(Exception, match="unknown output 'nope'"):
        remote.execute_multi(url, [np.array(["x"])], ["prompt"], ["nope"])


def test_auto_policy_gives_go_clients_an_http_status_with_the_message(url: str) -> None:
    body = infer_buffer([np.array(["x"])], None, ["logits"])
    reply = requests.post(url, data=body, headers={"User-Agent": "Go-http-client/1.1"}, timeout=30)
    assert reply.status_code == 400 and "unknown output 'logits'" in reply.text
    assert reply.headers["content-type"].startswith("text/plain")


@pytest.fixture(scope="module")
def strict_server(server_factory: Any) -> Iterator[Any]:
    """Errors as HTTP statuses, a 4 kB body limit, GraphPipe only under /gp."""
    with server_factory(
        graphpipe_error_status="http", graphpipe_max_body_bytes=4096, graphpipe_path="/gp", graphpipe_root=False
    ) as server:
        yield server


def test_http_policy_puts_the_message_in_the_body(strict_server: Any) -> None:
    base = strict_server.http_url
    reply = requests.post(base + "/gp", data=b"junk junk junk", timeout=30)
    assert reply.status_code == 400 and "malformed GraphPipe request" in reply.text
    with pytest.raises(requests.HTTPError, match="400"):  # the Python client cannot see the message here
        remote.execute_multi(base + "/gp", [np.array(["x"])], ["prompt"], ["nope"])
    assert remote.execute_multi(base + "/gp", [np.array(["x"])], [], ["lengths"], '{"max_tokens": 1}')[0].tolist() == [
        1
    ]
    assert requests.get(base + "/gp/control/is_ready", timeout=30).text.strip() == "ok"
    assert requests.post(base + "/", data=metadata_buffer(), timeout=30).status_code in {404, 405}


def test_body_limit_refuses_without_reading(strict_server: Any) -> None:
    base = strict_server.http_url
    big = infer_buffer([np.array(["x" * 10_000])])
    reply = requests.post(base + "/gp", data=big, timeout=30)
    assert reply.status_code == 413 and "at most 4096 bytes" in reply.text
    # Expect: 100-continue: refused from the Content-Length, the body is never asked for
    interim, final = raw_exchange(base, "/gp", big, {}, expect=True)
    status, payload = split_http(final)
    assert interim == b"" and status == 413 and b"at most 4096 bytes" in payload
    # chunked (no Content-Length): stopped once the limit is crossed
    reply = requests.post(base + "/gp", data=iter([big[:3000], big[3000:]]), timeout=30)
    assert reply.status_code == 413 and "over 4096 bytes" in reply.text
    assert requests.get(base + "/gp/control/is_alive", timeout=30).text.strip() == "ok"


def test_body_limit_in_the_flatbuffer_policy(server_factory: Any) -> None:
    with server_factory(graphpipe_max_body_bytes=1024) as server:
        reply = requests.post(server.http_url, data=infer_buffer([np.array(["x" * 5000])]), timeout=30)
        outputs, errors = read_response(reply.content)
        assert reply.status_code == 200 and outputs == []
        assert errors[0]["code"] == Code.RESOURCE_EXHAUSTED and b"at most 1024 bytes" in errors[0]["message"]


def test_bearer_token_is_checked_on_post_and_get_but_not_on_control_routes(server_factory: Any) -> None:
    with server_factory(auth_token="s3cret") as server:
        base = server.http_url
        body = infer_buffer([np.array(["x"])], [], ["lengths"], '{"max_tokens": 1}')
        outputs, errors = read_response(requests.post(base, data=body, timeout=30).content)
        assert outputs == [] and errors[0]["code"] == Code.UNAUTHENTICATED
        assert requests.get(base + "/graphpipe", timeout=30).status_code == 401
        ok = requests.post(base, data=body, headers={"Authorization": "Bearer s3cret"}, timeout=30)
        outputs, errors = read_response(ok.content)
        assert errors == [] and outputs[0].tolist() == [1]
        assert requests.get(base + "/graphpipe/control/is_ready", timeout=30).text.strip() == "ok"


def test_a_client_that_goes_away_cancels_its_rows(url: str, live_server: Any) -> None:
    import time

    admission = live_server.service.pool.admission
    body = infer_buffer([np.array(["a", "b"])], [], ["lengths"], '{"max_tokens": 400, "stop_token_ids": []}')
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        head = f"POST /graphpipe HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while admission.active < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert admission.active == 2  # both rows are generating
    deadline = time.monotonic() + 10
    while admission.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert admission.active == 0
