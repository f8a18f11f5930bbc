"""The playground page: served by the gateway alone, and driven in a real headless Chromium."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = "/usr/bin/chromedriver"
STATIC = Path(__file__).resolve().parents[2] / "gateway" / "playground"


def test_page_and_assets_are_served(live_server) -> None:
    page = httpx.get(live_server.http_url + "/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/playground/app.js" in page.text
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        asset = httpx.get(f"{live_server.http_url}/playground/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    assert httpx.get(live_server.http_url + "/playground/nope.js").status_code == 404


def test_manifest_describes_the_readouts(live_server) -> None:
    body = httpx.get(live_server.http_url + "/playground/manifest.json").json()
    readouts = live_server.service.info().readouts
    assert body["ready"] and body["model"] == live_server.service.info().model_id
    assert body["readouts"]["concepts"] == list(readouts.concepts)
    assert body["readouts"]["layers"] == list(readouts.layers)


def test_nothing_is_loaded_from_elsewhere() -> None:
    for path in STATIC.iterdir():
        if path.suffix in (".html", ".js", ".css"):
            text = path.read_text()
            assert not re.search(r"(src|href)=[\"']?(https?:)?//", text), path.name
            assert not re.search(r"@import|url\(\s*[\"']?https?:", text), path.name
            assert 'fetch("http' not in text and "fetch('http" not in text, path.name


def test_manifest_needs_the_token_when_auth_is_on(server_factory) -> None:
    with server_factory(auth_token="s3cret") as server:
        assert httpx.get(server.http_url + "/playground/manifest.json").status_code == 401
        ok = httpx.get(server.http_url + "/playground/manifest.json?access_token=s3cret")
        assert ok.status_code == 200 and ok.json()["ready"]


def test_playground_can_be_turned_off(server_factory) -> None:
    with server_factory(playground=False) as server:
        assert httpx.get(server.http_url + "/playground").status_code == 404


@pytest.fixture
def browser():  # type: ignore[no-untyped-def]
    if CHROMIUM is None or not Path(CHROMEDRIVER).exists():
        message = "chromium is not installed: apt-get update && apt-get install -y chromium chromium-driver"
        if os.environ.get("PRISMGATE_REQUIRE_BROWSER"):  # CI installs it: a missing browser is a failure there
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="prismgate-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(condition, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting in the browser")


def test_browser_streams_an_answer_with_shaded_tokens(live_server, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(live_server.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    concepts = [o.text for o in Select(browser.find_element(By.ID, "concept")).options]
    assert concepts == list(live_server.service.info().readouts.concepts)
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("12")

    browser.find_element(By.ID, "prompt").send_keys("Tell me about prisms")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done"))
    tokens = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok")
    assert len(tokens) == 12
    shaded = [t for t in tokens if t.get_attribute("data-value") and "rgba" in (t.get_attribute("style") or "")]
    assert len(shaded) == 12, [t.get_attribute("outerHTML") for t in tokens]
    assert all(t.get_attribute("data-logprob") for t in tokens)

    # another layer/concept re-shades; the tooltip shows readouts and the logprob
    before = [t.get_attribute("style") for t in tokens]
    Select(browser.find_element(By.ID, "concept")).select_by_index(1)
    Select(browser.find_element(By.ID, "layer")).select_by_index(0)
    assert [t.get_attribute("style") for t in tokens] != before
    from selenium.webdriver import ActionChains

    ActionChains(browser).move_to_element(tokens[0]).perform()
    tip = wait_for(
        lambda: browser.find_element(By.ID, "tooltip").is_displayed() and browser.find_element(By.ID, "tooltip")
    )
    assert "logprob" in tip.text and concepts[1] in tip.text

    # a second turn in the same session reuses the first
    browser.find_element(By.ID, "prompt").send_keys("And then?")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done")) == 2)
    second = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")[1]
    assert int(second.get_attribute("data-cached-tokens")) > 12
    assert not browser.find_elements(By.CSS_SELECTOR, ".turn.error")


# -- centers: a pack that has them, served through every manifest and used by the page ----------


def _centers(n_layers: int, n_concepts: int) -> np.ndarray:
    """Far from any readout of the tiny model, with alternating signs: centering flips every shade."""
    signs = np.array([[1.0 if (li + ci) % 2 == 0 else -1.0 for ci in range(n_concepts)] for li in range(n_layers)])
    return (signs * 1000.0 + 0.25).astype(np.float32)


@pytest.fixture(scope="module")
def centered(tiny_pack: Path, server_factory, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A live server whose concept pack has centers (the shared tiny pack has none)."""
    from prismgate.engines.readouts.pack import ConceptPack

    base = ConceptPack.load(tiny_pack)
    pack = dataclasses.replace(base, centers=_centers(len(base.layers), len(base.concepts)))
    path = tmp_path_factory.mktemp("centered") / "centered.safetensors"
    pack.save(path)
    with server_factory(concept_pack=str(path)) as server:
        yield server, pack


async def _evergreen_header(server) -> dict:  # type: ignore[no-untyped-def]
    import websockets

    from tests.evergreen.wire import Collector, generate, msg, text_leaf

    async with websockets.connect(server.ws_url + "/evergreen", max_size=None) as ws:
        action = generate("p", "r", config={"maxTokens": 1}, extra_outputs={"readouts": "ro"})
        await ws.send(msg(actions=[action], fragments=[text_leaf("p", "Hi")]))
        outs = await Collector(ws).until_complete("r", "ro")
        return outs["ro"].lines[0]


async def test_every_manifest_carries_the_centers(centered) -> None:  # type: ignore[no-untyped-def]
    server, pack = centered
    expected = pack.centers.tolist()
    assert server.service.info().readouts.centers == tuple(tuple(row) for row in expected)
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        playground = (await http.get("/playground/manifest.json")).json()
        models = (await http.get("/v1/models")).json()
    assert playground["readouts"]["centers"] == expected
    assert models["data"][0]["prismgate"]["readouts"]["centers"] == expected
    header = await _evergreen_header(server)
    assert header["layers"] == list(pack.layers)
    np.testing.assert_allclose(np.array(header["centers"]), pack.centers, rtol=1e-6)


async def test_manifests_say_null_without_centers(live_server) -> None:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(base_url=live_server.http_url) as http:
        playground = (await http.get("/playground/manifest.json")).json()
        models = (await http.get("/v1/models")).json()
    assert "centers" in playground["readouts"] and playground["readouts"]["centers"] is None
    assert "centers" in models["data"][0]["prismgate"]["readouts"]
    assert models["data"][0]["prismgate"]["readouts"]["centers"] is None
    assert (await _evergreen_header(live_server))["centers"] is None


def test_browser_shades_value_minus_center(centered, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    server, pack = centered
    browser.get(server.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    max_tokens = browser.find_element(By.ID, "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys("6")
    browser.find_element(By.ID, "prompt").send_keys("Tell me about prisms")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done"))
    tokens = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok")
    assert len(tokens) == 6
    for li in range(len(pack.layers)):
        for ci in range(len(pack.concepts)):
            Select(browser.find_element(By.ID, "layer")).select_by_index(li)
            Select(browser.find_element(By.ID, "concept")).select_by_index(ci)
            center = float(pack.centers[li, ci])
            for t in tokens:
                raw, shown = float(t.get_attribute("data-value")), float(t.get_attribute("data-centered"))
                assert shown == pytest.approx(raw - center, abs=1e-3)
                # The centers are far off every raw value: a shade follows value - center, not the value.
                colour = "30, 144, 255" if center > 0 else "255, 140, 0"
                assert colour in t.get_attribute("style"), (li, ci, raw, t.get_attribute("style"))

    ActionChains(browser).move_to_element(tokens[0]).perform()
    tip = wait_for(
        lambda: browser.find_element(By.ID, "tooltip").is_displayed() and browser.find_element(By.ID, "tooltip")
    )
    assert "minus the concept's center" in tip.text
    cells = tip.find_elements(By.CSS_SELECTOR, "tr.sel td")
    raw = float(cells[1].text)
    assert float(cells[2].text) == pytest.approx(raw - float(pack.centers[-1, -1]), abs=2e-3)
