"""http(s) refs, when a server turns them on: fetched with httpx under size and time limits.

A real HTTP server on loopback plays the remote store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import websockets

from tests.evergreen.test_websocket import aborted
from tests.evergreen.wire import Collector, generate, msg

BODIES = {"/question.txt": b"What colour is the sky?", "/big.txt": b"x" * 5000}


class _Store(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow.txt":
            time.sleep(2.0)
        body = BODIES.get(self.path, b"slow" if self.path == "/slow.txt" else None)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def store_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def ref_prompt(url: str, *, usage: bool = False) -> str:
    extra = {"usage": "u"} if usage else None
    return msg(
        actions=[generate("p", "r", config={"maxTokens": 2}, extra_outputs=extra)],
        fragments=[{"id": "p", "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "ref": url}}],
    )


async def test_a_fetched_ref_becomes_the_prompt(server_factory: Any, store_url: str) -> None:
    with server_factory(evergreen_http_refs=True) as server:
        async with websockets.connect(server.ws_url + "/evergreen") as ws:
            await ws.send(ref_prompt(store_url + "/question.txt", usage=True))
            usage = (await Collector(ws).until_complete("u"))["u"].lines[0]
            # the byte-level tiny tokenizer: one token per byte of the fetched text, plus the chat frame
            assert usage["promptTokens"] > len(BODIES["/question.txt"])
            assert usage["completionTokens"] == 2


@pytest.mark.parametrize(
    ("path", "code", "words"),
    [
        ("/big.txt", 4429, "larger than the limit 1000 bytes"),
        ("/missing.txt", 4400, "HTTP 404 fetching"),
        ("/slow.txt", 4503, "took over 0.5s fetching"),
    ],
)
async def test_fetch_limits_and_failures_abort_with_a_reason(
    server_factory: Any, store_url: str, path: str, code: int, words: str
) -> None:
    with server_factory(evergreen_http_refs=True, evergreen_ref_max_bytes=1000, evergreen_ref_timeout_s=0.5) as server:
        got_code, reason = await aborted(server, ref_prompt(store_url + path))
        assert got_code == code and words in reason, (got_code, reason)


async def test_http_refs_are_off_by_default(live_server: Any, store_url: str) -> None:
    got_code, reason = await aborted(live_server, ref_prompt(store_url + "/question.txt"))
    assert got_code == 4400 and "disabled" in reason
