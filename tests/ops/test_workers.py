"""``prismgate serve --workers 2``: two front-end processes over one engine host, as a user starts it.

Every test talks to the real command over real sockets (HTTP, WebSocket, gRPC) on the tiny
model. Which front-end answered an HTTP request is in its ``prismgate-worker`` header; each
new HTTP connection goes to whichever front-end the kernel hands it to, so a test that needs
both makes fresh connections until it has seen both.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from prismgate.core import health
from prismgate.core.health import Health
from prismgate.workers.host import Status
from prismgate.workers.remote import HostLink, RemotePool
from tests.conftest import TINY_MODEL_ID
from tests.evergreen.wire import Collector, generate, msg, text_leaf
from tests.ops.helpers import scrape, serve, value
from tests.ops.test_keys import auth, write_keys
from tests.ops.test_shutdown import stream_completion
from tests.salience.conftest import connect
from tests.serve_process import PRISMGATE, Served

pytestmark = pytest.mark.slow

TRIES = 60  # fresh connections before a test gives up on reaching both front-ends


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    with serve(tmp_path_factory.mktemp("workers"), tiny_model_dir, "--workers", "2") as running:
        yield running


def chat(url: str, **body: Any) -> httpx.Response:
    request = {"model": TINY_MODEL_ID, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **body}
    return httpx.post(f"{url}/v1/chat/completions", json=request, timeout=60)  # a new connection each time


def test_two_front_ends_serve_openai_evergreen_and_salience(served: Served) -> None:
    answer = chat(served.http_url)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert answer.headers["prismgate-worker"] in {"0", "1"}

    async def evergreen() -> bool:
        url = served.http_url.replace("http://", "ws://") + "/evergreen"
        async with websockets.connect(url) as ws:
            await ws.send(msg(actions=[generate("p", "r", config={"maxTokens": 2})], fragments=[text_leaf("p", "a")]))
            return bool((await Collector(ws).until_complete("r"))["r"].complete)

    assert asyncio.run(evergreen())
    client = connect(served.grpc_target)
    try:
        sid = client.open()
        tokens, done = client.generate(session_id=sid, append_tokens=[5, 6, 7], max_tokens=2, top_k=1)
        assert len(tokens) == 2 and done.completion_tokens == 2
        assert client.dump(sid)[:3] == [5, 6, 7]
    finally:
        client.channel.close()


def test_a_session_continues_on_the_other_front_end_with_its_cache(served: Served) -> None:
    opened = httpx.post(f"{served.http_url}/v1/sessions", json={}, timeout=30)
    assert opened.status_code == 200, opened.text
    sid = opened.json()["id"]
    workers: set[str] = set()
    length = 0
    for turn in range(TRIES):
        answer = chat(served.http_url, session_id=sid, max_tokens=2, temperature=0)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["prismgate"]["session_length"] > length  # every turn extends the one timeline
        if turn:  # the engine host kept the session's KV cache, whichever front-end sent the turn
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= length - 1
        length = body["prismgate"]["session_length"]
        workers.add(answer.headers["prismgate-worker"])
        if workers == {"0", "1"} and turn >= 3:
            break
    assert workers == {"0", "1"}, "the kernel never handed a connection to the second front-end"
    for _ in range(4):  # whichever front-end answers, it sees the same session
        seen = httpx.get(f"{served.http_url}/v1/sessions/{sid}", timeout=30)
        assert seen.status_code == 200 and seen.json()["length"] == length


def test_a_salience_session_is_shared_by_channels_on_either_front_end(served: Served) -> None:
    clients = [connect(served.grpc_target) for _ in range(6)]  # six connections: the kernel spreads them
    try:
        sid = clients[0].open()
        expected = 0
        for client in clients:
            _, done = client.generate(session_id=sid, append_tokens=[9, 8], offset=expected, max_tokens=1, top_k=1)
            expected += 3
            assert done.completion_tokens == 1
            assert len(client.dump(sid)) == expected
    finally:
        for client in clients:
            client.channel.close()


def test_metrics_sum_both_front_ends(served: Served) -> None:
    def requests() -> float:
        return value(scrape(served.http_url), "prismgate_requests_total", protocol="openai")

    before = requests()
    workers: list[str] = []
    for _ in range(TRIES):
        answer = chat(served.http_url)
        assert answer.status_code == 200
        workers.append(answer.headers["prismgate-worker"])
        if len(set(workers)) == 2 and len(workers) >= 4:
            break
    assert set(workers) == {"0", "1"}
    samples = [scrape(served.http_url) for _ in range(4)]  # front-ends scraped in turn all see the total
    for sample in samples:
        assert value(sample, "prismgate_requests_total", protocol="openai") == before + len(workers)
        assert value(sample, "prismgate_ready") == 1
        assert value(sample, "prismgate_engine_max_active") == 64  # the host's admission, mirrored once
        assert value(sample, "prismgate_sessions_open") >= 1  # the sessions the earlier tests opened, in the host


def test_readiness_waits_for_every_front_end() -> None:
    link = HostLink("/nonexistent", workers=3)
    link.models = [TINY_MODEL_ID]
    ready = {TINY_MODEL_ID: health.READY}
    link.status = Status(health=ready, in_flight={}, frontends=2)
    pool = RemotePool(link)
    assert pool.health().state is health.HealthState.LOADING
    assert "2 of 3" in pool.health().reason
    link.status = Status(health=ready, in_flight={}, frontends=3)
    assert pool.health().ready
    link.status = Status(health={TINY_MODEL_ID: Health(health.HealthState.LOADING)}, in_flight={}, frontends=3)
    assert not pool.health().ready
    link.gone = True
    assert pool.health().state is health.HealthState.FAILED


def test_a_front_end_mirrors_the_hosts_admission_counts() -> None:
    link = HostLink("/nonexistent", workers=2)
    link.models = [TINY_MODEL_ID]
    pool = RemotePool(link)
    assert (pool.admission.active, pool.admission.queued, pool.admission.preemptions) == (0, 0, 0)
    link.status = Status(health={}, in_flight={}, active=4, queued=2, max_active=8, preemptions=3)
    assert (pool.admission.active, pool.admission.queued, pool.admission.max_active) == (4, 2, 8)
    assert pool.admission.preemptions == 3  # what /metrics exports as prismgate_engine_preemptions_total


def test_a_port_another_program_holds_fails_the_start(tmp_path: Path, tiny_model_dir: Path) -> None:
    for flag in ("--grpc-port", "--http-port"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = str(taken.getsockname()[1])
            other = "--http-port" if flag == "--grpc-port" else "--grpc-port"
            command = [PRISMGATE, "serve", "--workers", "2", "--host", "127.0.0.1", flag, port, other, "0"]
            command += ["--model", str(tiny_model_dir), "--concept-pack", "none"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1
        assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and flag in done.stderr


def test_sigterm_drains_a_stream_on_a_front_end_then_exits_0(tmp_path: Path, long_model_dir: Path) -> None:
    with serve(tmp_path, long_model_dir, "--workers", "2", "--shutdown-grace-s", "30") as running:
        decoding = threading.Event()
        result: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: result.update(stream_completion(running.http_url, 2000, decoding.set)))
        reader.start()
        assert decoding.wait(60)
        running.process.send_signal(signal.SIGTERM)
        reader.join(90)
        assert running.process.wait(60) == 0, running.log_path.read_text()
    assert result["done"] and result["finish_reason"] == "length" and result["error"] is None, result
    logs = running.logs()
    messages = [line["message"] for line in logs]
    drained = [line for line in logs if line["message"] == "drained"]
    assert len(drained) == 2 and max(line["in_flight_at_stop"] for line in drained) == 1  # both front-ends drained
    shutting = messages.index("shutting down (grace 30.0s)")
    finished = messages.index("generation finished")
    assert finished > shutting, "the stream was not running at SIGTERM"
    last_drained = max(i for i, message in enumerate(messages) if message == "drained")
    assert messages.index("engine host stopped") > last_drained
    assert logs[-1]["message"] == "stopped" and logs[-1]["exit_status"] == 0
    assert not running.port_file.exists()


def test_a_keys_limit_holds_across_front_ends_and_sighup_keeps_serving(tmp_path: Path, long_model_dir: Path) -> None:
    """The host counts a key's leases: while its one allowed stream runs on one front-end, the
    other front-end refuses the key too."""
    keys = tmp_path / "keys.toml"
    write_keys(keys, ["single"])
    with serve(tmp_path, long_model_dir, "--workers", "2", "--keys-file", str(keys)) as running:
        body = {"model": TINY_MODEL_ID, "prompt": "hello", "max_tokens": 3000, "stream": True, "temperature": 0}
        first: dict[str, str] = {}
        streaming = threading.Event()
        stop = threading.Event()

        def hold() -> None:
            with httpx.stream("POST", running.http_url + "/v1/completions", json=body, headers=auth("single"),
                              timeout=120) as response:  # fmt: skip
                first["worker"] = response.headers["prismgate-worker"]
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        streaming.set()
                    if stop.is_set():
                        break

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert streaming.wait(60)
            refusals: set[str] = set()
            for _ in range(TRIES):
                answer = httpx.post(running.http_url + "/v1/completions", json={**body, "stream": False,
                                    "max_tokens": 1}, headers=auth("single"), timeout=60)  # fmt: skip
                assert answer.status_code == 429, answer.text
                assert "max_concurrent" in answer.json()["error"]["message"]
                refusals.add(answer.headers["prismgate-worker"])
                if refusals == {"0", "1"}:
                    break
            assert refusals == {"0", "1"}, f"only front-end {refusals} was reached"
        finally:
            stop.set()
            holder.join(120)
        running.process.send_signal(signal.SIGHUP)  # passed to the front-ends: the keys file read again
        time.sleep(1)
        assert running.process.poll() is None
        answered: list[int] = []
        deadline = time.monotonic() + 30  # the held stream's lease is returned once its cancellation reaches the host
        while answered.count(200) < 4 and time.monotonic() < deadline:
            answer = httpx.post(running.http_url + "/v1/completions", json={**body, "stream": False, "max_tokens": 1},
                                headers=auth("single"), timeout=60)  # fmt: skip
            answered.append(answer.status_code)
            assert answer.status_code in (200, 429), answer.text
        assert answered.count(200) == 4 and answered[-4:] == [200] * 4, answered


def test_a_front_end_that_dies_stops_the_server_with_status_1(tmp_path: Path, tiny_model_dir: Path) -> None:
    import psutil

    with serve(tmp_path, tiny_model_dir, "--workers", "2") as running:
        host = next(line["host_pid"] for line in running.logs() if "host_pid" in line)
        children = psutil.Process(running.process.pid).children()
        front = [p for p in children if p.pid != host and "resource_tracker" not in " ".join(p.cmdline())]
        assert len(front) == 2
        front[0].send_signal(signal.SIGKILL)
        assert running.process.wait(60) == 1
    messages = [line["message"] for line in running.logs()]
    assert any(m.startswith("prismgate-frontend-") and "exited with status -9" in m for m in messages), messages
    assert "engine host stopped" in messages  # the rest stopped in order


def test_sigkill_to_the_supervisor_takes_its_processes_with_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    import psutil

    with serve(tmp_path, tiny_model_dir, "--workers", "2") as running:  # stopped by SIGKILL at the end
        children = psutil.Process(running.process.pid).children(recursive=True)
        assert len(children) >= 3  # the host and two front-ends (and multiprocessing's resource tracker)
    _gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
