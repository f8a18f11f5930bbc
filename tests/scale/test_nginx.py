"""Real nginx (deploy/nginx/prismgate.conf) in front of two real gateways sharing Redis.

Affinity is the balancer's job: a conversation stays on one replica and reuses that
replica's KV cache, shown by the cached-token counts and by which replica did the work.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from tests.evergreen.wire import Collector, generate, msg, parent, text_leaf
from tests.ops.helpers import Served, serve
from tests.salience.conftest import connect
from tests.scale.conftest import Nginx, RedisServer, nginx_in_front

pytestmark = pytest.mark.slow


@pytest.fixture
def balanced(tmp_path: Path, tiny_model_dir: Path, redis: RedisServer) -> Iterator[tuple[Nginx, list[Served]]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    store = ("--session-store", redis.url)
    with (
        serve(tmp_path / "a", tiny_model_dir, *store) as a,
        serve(tmp_path / "b", tiny_model_dir, *store) as b,
        nginx_in_front(tmp_path / "nginx", [a, b]) as nginx,
    ):
        yield nginx, [a, b]


def requests_served(gateway: Served, protocol: str) -> float:
    """The gateway's own count of finished requests of ``protocol`` (read from it directly)."""
    total = 0.0
    for line in httpx.get(gateway.http_url + "/metrics").text.splitlines():
        if line.startswith("prismgate_requests_total{") and f'protocol="{protocol}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_an_openai_conversation_through_nginx_stays_on_one_replica(balanced: tuple[Nginx, list[Served]]) -> None:
    nginx, gateways = balanced
    sid = httpx.post(nginx.http_url + "/v1/sessions", json={"model": "tiny-llama"}).json()["id"]
    before = [requests_served(g, "openai") for g in gateways]
    length = 0
    for i in range(4):
        r = httpx.post(
            nginx.http_url + "/v1/chat/completions",
            headers={"X-Session-Id": sid},  # what the balancer hashes on
            json={
                "model": "tiny-llama",
                "session_id": sid,
                "messages": [{"role": "user", "content": f"turn {i}"}],
                "max_tokens": 4,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        if i:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= length - 1, (i, usage, length)
        length = r.json()["prismgate"]["session_length"]
    served = [requests_served(g, "openai") - b for g, b in zip(gateways, before, strict=True)]
    assert sorted(served) == [0, 4], served  # one replica did every turn


async def test_an_evergreen_conversation_through_nginx_reuses_its_prefix(
    balanced: tuple[Nginx, list[Served]],
) -> None:
    nginx, gateways = balanced
    async with websockets.connect(nginx.http_url.replace("http://", "ws://") + "/evergreen") as ws:
        c = Collector(ws)
        await ws.send(
            msg(
                actions=[generate("p", "r", config={"maxTokens": 4}, extra_outputs={"usage": "u"})],
                fragments=[parent("p", "q"), text_leaf("q", "Hello there, how are you today?")],
            )
        )
        first = (await c.until_complete("r", "u"))["u"].lines[0]
        for turn in range(2):
            await ws.send(
                msg(
                    actions=[
                        generate(f"p{turn}", f"r{turn}", config={"maxTokens": 3}, extra_outputs={"usage": f"u{turn}"})
                    ],
                    fragments=[parent(f"p{turn}", "p", "r", f"q{turn}"), text_leaf(f"q{turn}", "And then?")],
                )
            )
            usage = (await c.until_complete(f"r{turn}", f"u{turn}"))[f"u{turn}"].lines[0]
            assert usage["cachedTokens"] >= first["promptTokens"], usage
    assert sorted(requests_served(g, "evergreen") for g in gateways)[0] == 0  # the other replica saw none


def test_salience_through_nginx_hashes_on_the_session_metadata(balanced: tuple[Nginx, list[Served]]) -> None:
    nginx, gateways = balanced
    client = connect(nginx.grpc_target)
    try:
        sid = client.open()
        metadata = (("x-session-id", sid),)
        timeline: list[int] = []
        for append in ([5, 6, 7, 8], [9], [10]):
            tokens, _ = client.generate(
                session_id=sid, append_tokens=append, offset=len(timeline), max_tokens=2, top_k=1, metadata=metadata
            )
            timeline += append + [t.id for t in tokens if not t.is_prefill]
        assert client.dump(sid, metadata=metadata) == timeline
        served = sorted(requests_served(g, "salience") for g in gateways)
        assert served == [0, 3], served  # every Generate of the session went to one replica
    finally:
        client.channel.close()
