"""HTTP answers on a keep-alive connection are not held back by Nagle's algorithm.

Regression test: the gateway binds its HTTP socket itself, and asyncio only sets
TCP_NODELAY on sockets whose ``proto`` is IPPROTO_TCP. Without it every keep-alive response
(headers, then body, in two writes) waited ~40 ms for the client's delayed ACK, which showed
as a 20-30x TTFT on GraphPipe and the OpenAI API in bench/overhead.py.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import httpx


def test_keepalive_requests_answer_in_milliseconds(live_server: Any) -> None:
    with httpx.Client(timeout=10) as http:  # one connection, reused
        http.get(live_server.http_url + "/healthz")
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            assert http.get(live_server.http_url + "/healthz").text == "ok"
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.02, f"median {statistics.median(times) * 1e3:.1f} ms: Nagle + delayed ACK?"
