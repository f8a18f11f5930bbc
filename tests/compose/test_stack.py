"""The compose stack's scale profile in a real container engine, checked from outside.

``make test-compose`` builds the images (locally from Debian packages where no registry is
reachable) and runs this module: ``docker compose --profile scale up --wait``, then every check
goes through nginx's published ports as a client would (the replicas' own loopback ports only
tell which replica did the work), and ``down -v`` must leave nothing behind. It needs a container
engine and the images, so it is marked ``compose`` and ``make test`` leaves it out.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.evergreen.wire import Collector, generate, msg, parent, text_leaf
from tests.salience.conftest import connect

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
# published ports whose defaults lie in Linux's ephemeral range (32768-60999), with the stand-in
# this test publishes on instead, below it: any process may hold an ephemeral port (an outgoing
# connection, a server bound to port 0), and CI runs the other tiers beside this one
EPHEMERAL_DEFAULTS = {
    "PRISMGATE_LB_GRPC_PUBLISH": 20050,
    "PRISMGATE_A_GRPC_PUBLISH": 20151,
    "PRISMGATE_B_GRPC_PUBLISH": 20152,
}


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _publish_outside_the_ephemeral_range() -> None:
    """Set each of :data:`EPHEMERAL_DEFAULTS` the caller left unset to a free port below the
    ephemeral range (its stand-in or the next free one), for compose and for this module alike."""
    for name, port in EPHEMERAL_DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = str(next(p for p in range(port, port + 100) if _free(p)))


_publish_outside_the_ephemeral_range()
PROJECT = os.environ.get("COMPOSE_PROJECT_NAME", "prismgate")
LABEL = f"label=com.docker.compose.project={PROJECT}"
LB_HTTP = f"http://127.0.0.1:{os.environ.get('PRISMGATE_LB_HTTP_PUBLISH', '8080')}"
LB_GRPC = f"127.0.0.1:{os.environ.get('PRISMGATE_LB_GRPC_PUBLISH', '50050')}"
PROMETHEUS = f"http://127.0.0.1:{os.environ.get('PROMETHEUS_PUBLISH', '9090')}"
REPLICAS = {
    "gateway-a": f"http://127.0.0.1:{os.environ.get('PRISMGATE_A_HTTP_PUBLISH', '8101')}",
    "gateway-b": f"http://127.0.0.1:{os.environ.get('PRISMGATE_B_HTTP_PUBLISH', '8102')}",
}
MODEL = "SmolLM2-135M-Instruct"
MEASUREMENTS = ROOT / "build" / "compose" / "measurements.json"


def run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{' '.join(args)}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def compose(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run("docker", "compose", "--profile", "scale", *args, timeout=timeout, check=check)


def leftovers() -> dict[str, list[str]]:
    """Containers, networks and volumes of this compose project that exist now."""
    return {
        kind: run("docker", *command, "--filter", LABEL, "--format", field).stdout.split()
        for kind, command, field in (
            ("containers", ("ps", "-a"), "{{.Names}}"),
            ("networks", ("network", "ls"), "{{.Name}}"),
            ("volumes", ("volume", "ls"), "{{.Name}}"),
        )
    }


def engine_or_skip() -> None:
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no container engine: docker cannot be run ({exc}); make test-compose starts one")
    if info.returncode != 0:
        pytest.skip(f"no container engine answers `docker info`: {info.stderr.strip()[-300:]}")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no Compose v2 (`docker compose`): make compose-plugins installs a pinned one")


def record(key: str, value: Any) -> None:
    MEASUREMENTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(MEASUREMENTS.read_text()) if MEASUREMENTS.exists() else {}
    data[key] = value
    MEASUREMENTS.write_text(json.dumps(data, indent=2) + "\n")


@pytest.fixture(scope="module")
def stack() -> Iterator[None]:
    engine_or_skip()
    assert leftovers() == {"containers": [], "networks": [], "volumes": []}, "the project is already up: down -v first"
    MEASUREMENTS.unlink(missing_ok=True)
    start = time.monotonic()
    try:
        up = compose("up", "--detach", "--wait", "--wait-timeout", "600", timeout=660, check=False)
        record("time_to_healthy_s", round(time.monotonic() - start, 1))
        assert up.returncode == 0, (
            f"up --wait failed (make test-compose builds the images, and names local stand-ins where no "
            f"registry is reachable):\n{up.stderr[-3000:]}\n{compose('logs', '--tail', '40').stdout}"
        )
        yield
    finally:
        compose("down", "--volumes", "--timeout", "60", timeout=180, check=False)


def requests_served(replica: str, protocol: str) -> float:
    """The replica's own count of finished requests of ``protocol``, read from its loopback port."""
    text = httpx.get(REPLICAS[replica] + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prismgate_requests_total{") and f'protocol="{protocol}"' in line
    )


def served_counts(protocol: str) -> dict[str, float]:
    return {name: requests_served(name, protocol) for name in REPLICAS}


def chat(session: str, content: str, *, max_tokens: int = 8) -> dict[str, Any]:
    r = httpx.post(
        LB_HTTP + "/v1/chat/completions",
        headers={"X-Session-Id": session},
        json={
            "model": MODEL,
            "session_id": session,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_an_openai_chat_answers_through_nginx(stack: None) -> None:
    r = httpx.post(
        LB_HTTP + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL and body["usage"]["completion_tokens"] > 0
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_a_salience_session_lives_in_redis_across_both_replicas(stack: None) -> None:
    client = connect(LB_GRPC)
    try:
        sid = client.open(MODEL)
        timeline: list[int] = []
        before = served_counts("salience")
        landed: list[str] = []
        # Each turn names a fresh affinity key, so nginx's hash spreads the turns; keep going
        # until both replicas have served one (a fair coin: 12 turns all on one side is 1 in 2048).
        for turn in range(12):
            tokens, _ = client.generate(
                session_id=sid,
                append_tokens=[100 + turn],
                offset=len(timeline),
                max_tokens=2,
                top_k=1,
                metadata=(("x-session-id", uuid.uuid4().hex),),
            )
            timeline += [100 + turn] + [t.id for t in tokens if not t.is_prefill]
            after = served_counts("salience")
            landed += [name for name in REPLICAS if after[name] > before[name]]
            before = after
            if turn >= 2 and set(landed) == set(REPLICAS):
                break
        assert set(landed) == set(REPLICAS), f"every turn landed on {landed}"
        # the whole timeline, read back through either replica, is the one the turns built
        for key in ("a", "b", "c", "d"):
            assert client.dump(sid, metadata=(("x-session-id", key),)) == timeline
    finally:
        client.channel.close()


async def test_an_evergreen_websocket_conversation_through_nginx(stack: None) -> None:
    async with websockets.connect(LB_HTTP.replace("http://", "ws://") + "/evergreen", open_timeout=30) as ws:
        c = Collector(ws)
        await ws.send(
            msg(
                actions=[generate("p", "r", config={"maxTokens": 6}, extra_outputs={"usage": "u"})],
                fragments=[parent("p", "q"), text_leaf("q", "Hello there, how are you today?")],
            )
        )
        first = await c.until_complete("r", "u")
        assert first["r"].text and first["u"].lines[0]["completionTokens"] > 0
        await ws.send(
            msg(
                actions=[generate("p1", "r1", config={"maxTokens": 4}, extra_outputs={"usage": "u1"})],
                fragments=[parent("p1", "p", "r", "q1"), text_leaf("q1", "And then?")],
            )
        )
        usage = (await c.until_complete("r1", "u1"))["u1"].lines[0]
        assert usage["cachedTokens"] >= first["u"].lines[0]["promptTokens"], usage  # the same connection's replica


def test_prometheus_scrapes_every_gateway(stack: None) -> None:
    deadline = time.monotonic() + 120
    while True:
        targets = httpx.get(PROMETHEUS + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        gateways = {t["labels"]["instance"]: t for t in targets if t["labels"]["job"] == "prismgate"}
        if set(gateways) == {f"{name}:8000" for name in REPLICAS} and all(
            t["health"] == "up" for t in gateways.values()
        ):
            break
        assert time.monotonic() < deadline, f"Prometheus's gateway targets: {gateways}"
        time.sleep(2)
    query = httpx.get(PROMETHEUS + "/api/v1/query", params={"query": "prismgate_ready"}, timeout=10).json()
    ready = {r["metric"]["instance"]: r["value"][1] for r in query["data"]["result"]}
    assert ready == {f"{name}:8000": "1" for name in REPLICAS}


def test_the_gateways_run_as_a_non_root_user(stack: None) -> None:
    for name in REPLICAS:
        (container,) = compose("ps", "--quiet", name).stdout.split()
        assert run("docker", "inspect", "--format", "{{.Config.User}}", container).stdout.strip() == "10001:10001"
        status = run("docker", "exec", container, "cat", "/proc/1/status").stdout
        uid = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert set(uid) == {"10001"}, status


def test_a_killed_replica_loses_nothing_of_a_conversation(stack: None) -> None:
    sid = httpx.post(LB_HTTP + "/v1/sessions", json={"model": MODEL}, timeout=30).json()["id"]
    before = served_counts("openai")
    chat(sid, "My name is Ada. Remember it.")
    second = chat(sid, "What is my name?")
    served = {name: n - before[name] for name, n in served_counts("openai").items()}
    (home,) = [name for name, n in served.items() if n == 2]  # both turns on the session's replica
    (other,) = set(REPLICAS) - {home}
    length = httpx.get(f"{LB_HTTP}/v1/sessions/{sid}", headers={"X-Session-Id": sid}, timeout=30).json()["length"]
    assert length == second["prismgate"]["session_length"]

    (container,) = compose("ps", "--quiet", home).stdout.split()
    run("docker", "kill", container)
    other_before = requests_served(other, "openai")
    # The session as the other replica reads it from Redis: every token of both turns.
    killed = time.monotonic()
    after_kill = httpx.get(f"{LB_HTTP}/v1/sessions/{sid}", headers={"X-Session-Id": sid}, timeout=120)
    record("first_answer_after_kill_s", round(time.monotonic() - killed, 1))
    assert after_kill.status_code == 200 and after_kill.json()["length"] == length, after_kill.text
    third = chat(sid, "And what was my name again?")
    assert requests_served(other, "openai") == other_before + 1, "the other replica did not take the turn"
    assert third["prismgate"]["session_length"] > length
    assert third["usage"]["prompt_tokens"] > length  # the new turn's prompt holds the whole conversation


def test_down_leaves_no_container_network_or_volume(stack: None) -> None:
    compose("down", "--volumes", "--timeout", "60", timeout=180)
    assert leftovers() == {"containers": [], "networks": [], "volumes": []}
