"""``GET /``: a page for browsers, GraphPipe's metadata for everyone else."""

from __future__ import annotations

from typing import Any

import httpx

BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


def test_a_browser_gets_a_page_with_the_links(live_server: Any) -> None:
    r = httpx.get(live_server.http_url + "/", headers=BROWSER)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for href in ("/playground", "/v1/models", "/metrics", "/graphpipe"):
        assert f'href="{href}"' in r.text


def test_graphpipe_clients_keep_their_json(live_server: Any) -> None:
    for headers in ({}, {"Accept": "application/json"}, {"Accept": "*/*"}):
        r = httpx.get(live_server.http_url + "/", headers=headers)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json", headers
        assert r.json()["Server"] == "prismgate"


def test_the_page_needs_no_token_but_graphpipe_still_does(server_factory: Any) -> None:
    with server_factory(auth_token="s3cret", playground=False) as server:
        page = httpx.get(server.http_url + "/", headers=BROWSER)
        assert page.status_code == 200 and 'href="/playground"' not in page.text
        assert httpx.get(server.http_url + "/").status_code == 401


def test_the_favicon_a_browser_asks_for_is_no_404(live_server: Any) -> None:
    r = httpx.get(live_server.http_url + "/favicon.ico", headers=BROWSER)
    assert r.status_code == 204 and r.content == b""
