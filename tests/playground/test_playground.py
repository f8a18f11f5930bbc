"""The playground page: served by the gateway alone, and driven in a real headless Chromium."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

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
    assert body["readouts"]["scales"] is None  # the tiny pack has none
    assert body["readouts"]["defaultLayer"] == len(readouts.layers) // 2  # no layer 16 in the tiny model
    assert body["readouts"]["defaultConcept"] == (
        readouts.concepts.index("question") if "question" in readouts.concepts else 0
    )
    # steering: nothing measured for this pack, so its view layer, the full reach, every slider at 0
    assert body["readouts"]["steering"] == {
        "layer": readouts.layers[len(readouts.layers) // 2],
        "range": 64,
        "concept": None,
        "scale": 0,
        "concepts": {},
    }


def test_a_measured_pack_starts_steered_where_it_measured(calibrated_factory) -> None:  # type: ignore[no-untyped-def]
    """The manifest carries the pack's measured steering, and the page starts with its strongest concept steered."""
    from prismgate.engines.readouts.pack import SteeringRange

    measured = {"concept0": SteeringRange(1, 8.0, 16.0, 0.4), "concept2": SteeringRange(0, 16.0, 32.0, 1.5)}
    with calibrated_factory(steering=measured) as (server, pack):
        body = httpx.get(server.http_url + "/playground/manifest.json").json()["readouts"]
    assert body["steering"] == {
        "layer": 0,
        "range": 32.0,
        "concept": "concept2",
        "scale": 16.0,
        "concepts": {c: r.to_json() for c, r in measured.items()},
    }
    assert body["defaultConcept"] == pack.concepts.index("concept2")  # shaded by the concept it steers


def test_a_pack_whose_concepts_never_moved_starts_unsteered() -> None:
    from prismgate.engines.readouts.pack import SteeringRange
    from prismgate.playground import steering_defaults

    layers, concepts = (4, 8, 16), ("code", "question")
    nothing = {"code": SteeringRange(8, 8.0, 32.0, 0.0), "question": SteeringRange(4, 8.0, 16.0, -0.1)}
    assert steering_defaults(layers, concepts, nothing) == {
        "layer": 16,
        "range": 32.0,
        "concept": None,
        "scale": 0,
        "concepts": {c: r.to_json() for c, r in nothing.items()},
    }


def test_the_page_first_shades_by_question_where_the_pack_has_it() -> None:
    from prismgate.playground import view_concept

    concepts = ("code", "formality", "french", "numeric", "past_tense", "question", "refusal", "sentiment")
    assert view_concept(concepts) == 5
    assert view_concept(("concept0", "concept1")) == 0


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
        # the query carrier is for WebSocket handshakes only: an HTTP client sends a header
        assert httpx.get(server.http_url + "/playground/manifest.json?access_token=s3cret").status_code == 401
        ok = httpx.get(server.http_url + "/playground/manifest.json", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["ready"]


def test_playground_can_be_turned_off(server_factory) -> None:
    with server_factory(playground=False) as server:
        assert httpx.get(server.http_url + "/playground").status_code == 404


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


# -- /playground/score: the prompt's tokens with their readouts ---------------------------------


def test_score_returns_every_prompt_token(live_server) -> None:  # type: ignore[no-untyped-def]
    from prismgate.core.chat import Message, TextPart, render

    messages = [{"role": "user", "content": "Tell me about prisms"}]
    body = httpx.post(live_server.http_url + "/playground/score", json={"messages": messages}).json()
    expected = render(live_server.service, [Message("user", [TextPart("Tell me about prisms")])]).tokens
    assert [t["tokenId"] for t in body["tokens"]] == list(expected)
    assert [t["position"] for t in body["tokens"]] == list(range(len(expected)))
    first, *rest = body["tokens"]
    assert first["values"] is None and first["logprob"] is None  # position 0: nothing to condition on
    n_layers, n_concepts = live_server.service.info().readouts.shape
    assert all(np.array(t["values"]).shape == (n_layers, n_concepts) for t in rest)
    assert all(t["logprob"] <= 0 for t in rest)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not JSON"),
        (b'{"messages": []}', 400, "non-empty list"),
        (b'{"messages": [{"role": "robot", "content": "hi"}]}', 400, "messages[0] must be"),
        (b'{"messages": [{"role": "user", "content": "hi", "tokens": ["a"]}]}', 400, "messages[0].tokens"),
        (b'{"messages": [{"role": "user", "content": "' + b"x" * (1 << 20) + b'"}]}', 413, "over 1048576 bytes"),
    ],
)
def test_score_refuses_bad_bodies(live_server, body: bytes, status: int, message: str) -> None:  # type: ignore[no-untyped-def]
    answer = httpx.post(live_server.http_url + "/playground/score", content=body)
    assert answer.status_code == status and message in answer.json()["error"], answer.text


def test_score_answers_a_context_overflow_with_400_like_v1(live_server) -> None:  # type: ignore[no-untyped-def]
    """A conversation longer than the context must change; 429 would tell a client to retry it as it is."""
    context = live_server.service.info().max_model_len
    messages = [{"role": "user", "content": " ".join(["hello"] * (context + 10))}]
    answer = httpx.post(live_server.http_url + "/playground/score", json={"messages": messages}, timeout=60)
    assert answer.status_code == 400 and answer.json()["code"] == "RESOURCE_EXHAUSTED", answer.text
    assert "context" in answer.json()["error"]
    v1 = httpx.post(
        live_server.http_url + "/v1/chat/completions",
        json={"model": live_server.service.info().model_id, "messages": messages},
        timeout=60,
    )
    assert v1.status_code == 400, v1.text


def test_score_refuses_tokens_outside_the_vocabulary(live_server) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tokens": [10**9]}]
    answer = httpx.post(live_server.http_url + "/playground/score", json={"messages": messages})
    assert answer.status_code == 400 and answer.json()["code"] == "INVALID_ARGUMENT"


def test_score_needs_the_token_when_auth_is_on(server_factory) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with server_factory(auth_token="s3cret") as server:
        assert httpx.post(server.http_url + "/playground/score", json=body).status_code == 401
        assert httpx.post(server.http_url + "/playground/score?access_token=s3cret", json=body).status_code == 401
        ok = httpx.post(server.http_url + "/playground/score", json=body, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["tokens"]


# -- the calibrated page: fixed scales, prompt shading, grids, legend, export ----------------------

ORANGE, BLUE = (255, 140, 0), (30, 144, 255)
SCREENSHOTS = os.environ.get("PRISMGATE_SCREENSHOTS")  # a folder to keep the screenshots in, to look at


@pytest.fixture(scope="module")
def calibrated_factory(tiny_pack: Path, server_factory, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Start a live server whose pack has centers and scales, as the pack builder writes them (and ``overrides``)."""
    from prismgate.engines.readouts.pack import ConceptPack

    @contextlib.contextmanager
    def start(**overrides: Any):  # type: ignore[no-untyped-def]
        base = ConceptPack.load(tiny_pack)
        shape = (len(base.layers), len(base.concepts))
        rng = np.random.default_rng(1)
        pack = dataclasses.replace(
            base,
            centers=rng.normal(0, 0.05, shape).astype(np.float32),
            scales=rng.uniform(0.05, 0.2, shape).astype(np.float32),
            **overrides,
        )
        path = tmp_path_factory.mktemp("calibrated") / "calibrated.safetensors"
        pack.save(path)
        with server_factory(concept_pack=str(path)) as server:
            yield server, pack

    return start


@pytest.fixture(scope="module")
def calibrated(calibrated_factory):  # type: ignore[no-untyped-def]
    """A live server whose pack has centers and scales, as the pack builder writes them."""
    with calibrated_factory() as started:
        yield started


def _ask(browser, server, prompt: str, max_tokens: int, *, new_chat: bool = True):  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    if new_chat:
        browser.get(server.http_url + "/playground")
        wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    done = len(browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done"))
    field = browser.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "send").click()
    wait_for(
        lambda: (
            len(browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done")) == done + 1
            and len(browser.find_elements(By.CSS_SELECTOR, ".turn.user.scored")) == done + 1
        )
    )
    turns = browser.find_elements(By.CSS_SELECTOR, ".turn")
    return turns[-2], turns[-1]  # the prompt's box and the answer's


def _pixels(element, name: str) -> np.ndarray:  # type: ignore[no-untyped-def]
    import io

    from PIL import Image

    png = element.screenshot_as_png
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        (Path(SCREENSHOTS) / f"{name}.png").write_bytes(png)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def _tinted(pixels: np.ndarray, rgb: tuple[int, int, int]) -> int:
    """Pixels whose colour is white blended with ``rgb`` (a shade of it), not grey text or background."""
    r, g, b = (pixels[..., i] for i in range(3))
    if rgb == ORANGE:
        return int(((r > 240) & (r - b > 40) & (g > b) & (r > g)).sum())
    return int(((b > 240) & (b - r > 40) & (g > r) & (b > g)).sum())


def test_calibrated_shading_of_prompt_and_answer(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    server, pack = calibrated
    browser.set_window_size(1280, 1000)
    prompt_box, answer_box = _ask(browser, server, "Tell me about prisms", 12)
    layer = int(browser.find_element(By.ID, "layer").get_attribute("value"))
    concept = int(browser.find_element(By.ID, "concept").get_attribute("value"))
    center, scale = float(pack.centers[layer, concept]), float(pack.scales[layer, concept])

    prompt_tokens = prompt_box.find_elements(By.CSS_SELECTOR, ".tok")
    answer_tokens = answer_box.find_elements(By.CSS_SELECTOR, ".tok")
    assert len(answer_tokens) == 12 and len(prompt_tokens) > 3
    for token in prompt_tokens[1:] + answer_tokens:  # position 0, the attention sink, stays unshaded
        raw = float(token.get_attribute("data-value"))
        assert float(token.get_attribute("data-centered")) == pytest.approx(raw - center, abs=1e-4)
        # strength = |value - center| / (2 * scale), capped at 1: fixed by the pack, not by the answer
        strength = min(1.0, abs(raw - center) / (2 * scale))
        assert float(token.get_attribute("data-strength")) == pytest.approx(strength, abs=1e-3)
    assert prompt_tokens[0].get_attribute("data-position") == "0"
    assert not prompt_tokens[0].get_attribute("style")

    # the shading is on screen, on the prompt as on the answer
    for box, name in ((prompt_box, "prompt"), (answer_box, "answer")):
        pixels = _pixels(box, f"calibrated-{name}")
        assert _tinted(pixels, ORANGE) + _tinted(pixels, BLUE) > 200, name

    # the legend prints the scale's numbers
    legend = browser.find_element(By.ID, "legend")
    assert legend.get_attribute("data-calibrated") == "1"
    assert float(legend.get_attribute("data-scale")) == pytest.approx(scale, rel=1e-6)
    ticks = browser.find_element(By.ID, "legend-ticks").text
    assert f"+{2 * scale:.2f}" in ticks and f"\u2212{2 * scale:.2f}" in ticks and "center" in ticks
    _pixels(browser.find_element(By.TAG_NAME, "body"), "calibrated-page")


def test_shades_do_not_depend_on_the_answer(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    """The same prompt, answered at two lengths: every shared token looks the same, to the pixel."""
    from selenium.webdriver.common.by import By

    server, _ = calibrated
    browser.set_window_size(1280, 1000)
    seen = []
    for max_tokens in (2, 16):
        prompt_box, answer_box = _ask(browser, server, "Tell me about prisms", max_tokens)
        answer = answer_box.find_elements(By.CSS_SELECTOR, ".tok")
        seen.append(
            (
                _pixels(prompt_box, f"independent-prompt-{max_tokens}"),
                [t.value_of_css_property("background-color") for t in answer[:2]],
                [_pixels(t, f"independent-token{i}-{max_tokens}") for i, t in enumerate(answer[:2])],
            )
        )
    (prompt_a, colours_a, tokens_a), (prompt_b, colours_b, tokens_b) = seen
    assert prompt_a.shape == prompt_b.shape and np.array_equal(prompt_a, prompt_b)
    assert colours_a == colours_b
    for a, b in zip(tokens_a, tokens_b, strict=True):
        # the token's own box, less a 2-pixel rim where a neighbour's shade (in the longer answer) may bleed in
        assert a.shape == b.shape and np.array_equal(a[2:-2, 2:-2], b[2:-2, 2:-2])


def test_grids_of_concepts_and_of_layers(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    server, pack = calibrated
    browser.set_window_size(1280, 1000)
    prompt_box, _ = _ask(browser, server, "Tell me about prisms", 8)
    shown = len(prompt_box.find_elements(By.CSS_SELECTOR, ".tok")) - 1 + 8  # position 0 has no readouts
    assert browser.find_element(By.ID, "grid").get_attribute("hidden")  # the text view has no grid

    for view, rows in (("concepts", pack.concepts), ("layers", [f"L{layer}" for layer in pack.layers])):
        browser.find_element(By.CSS_SELECTOR, f"#view input[value={view}]").find_element(By.XPATH, "..").click()
        table = browser.find_element(By.ID, "grid-table")
        assert table.get_attribute("data-view") == view
        heads = [th.text for th in table.find_elements(By.CSS_SELECTOR, "th.rowhead")]
        assert heads == list(rows)
        for row in table.find_elements(By.CSS_SELECTOR, "tr")[1:]:
            assert len(row.find_elements(By.CSS_SELECTOR, "td.cell")) == shown
        pixels = _pixels(browser.find_element(By.ID, "grid"), f"grid-{view}")
        assert _tinted(pixels, ORANGE) + _tinted(pixels, BLUE) > 500, view

    from selenium.webdriver import ActionChains

    ActionChains(browser).move_to_element(browser.find_elements(By.CSS_SELECTOR, "td.cell")[3]).perform()
    tip = wait_for(
        lambda: browser.find_element(By.ID, "tooltip").is_displayed() and browser.find_element(By.ID, "tooltip")
    )
    assert "value \u2212 center" in tip.text and "scales (1 scale =" in tip.text


def test_the_small_things_a_new_user_sees(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    """Tooltip headers, a second prompt without a blank first line, per-row scales in the grid legend,
    a legend note that stays readable at 760 px, and New chat reading as idle, not as an error."""
    from selenium.webdriver import ActionChains
    from selenium.webdriver.common.by import By

    server, pack = calibrated
    browser.set_window_size(760, 1000)
    _, answer = _ask(browser, server, "Tell me about prisms", 4)
    ActionChains(browser).move_to_element(answer.find_elements(By.CSS_SELECTOR, ".tok")[0]).perform()
    tip = wait_for(
        lambda: browser.find_element(By.ID, "tooltip").is_displayed() and browser.find_element(By.ID, "tooltip")
    )
    assert [th.text for th in tip.find_elements(By.CSS_SELECTOR, "th")] == ["concept", "raw", "\u2212 center", "scales"]

    second, _ = _ask(browser, server, "And then?", 2, new_chat=False)
    first = second.find_elements(By.CSS_SELECTOR, ".tok")[0]
    # no empty first line: the template's newline shows as a mark after an answer that ended with its end
    # token, and the end token itself opens the prompt after one cut at max_tokens (the tiny model's here)
    assert first.text in ("\u21b5", "<|im_end|>") and "special" in first.get_attribute("class"), first.text

    note = browser.find_element(By.ID, "legend-note")
    assert note.size["width"] > 400, note.size  # under the bar, not a sliver beside it
    browser.find_element(By.CSS_SELECTOR, "#view input[value=concepts]").find_element(By.XPATH, "..").click()
    text = browser.find_element(By.ID, "legend-note").text
    assert "one per row" in text and all(name in text for name in pack.concepts), text
    assert browser.find_elements(By.CSS_SELECTOR, "#legend-ticks b")[-1].text == "+2\u00d7"

    # moving a slider shades by the concept it steers; the sliders reach +-64 (nothing measured for this pack)
    _steer(browser, pack.concepts[2], 5)
    assert browser.find_element(By.ID, "concept").get_attribute("value") == "2"
    slider = browser.find_element(By.CSS_SELECTOR, f"#steer-sliders input[data-concept='{pack.concepts[2]}']")
    assert (slider.get_attribute("min"), slider.get_attribute("max")) == ("-64", "64")
    _steer(browser, pack.concepts[2], 0)

    browser.find_element(By.ID, "new-chat").click()
    time.sleep(0.5)  # the closed socket's close event comes after the click
    assert browser.find_element(By.ID, "status").text == "idle"
    assert not browser.find_elements(By.CSS_SELECTOR, ".turn")


def test_export_json_and_csv(calibrated, browser, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import csv
    import io
    import json

    from selenium.webdriver.common.by import By

    server, pack = calibrated
    browser.execute_cdp_cmd("Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    prompt_box, _ = _ask(browser, server, "Tell me about prisms", 4)
    _ask(browser, server, "And then?", 3, new_chat=False)
    browser.find_element(By.ID, "export-json").click()
    browser.find_element(By.ID, "export-csv").click()
    json_file, csv_file = tmp_path / "prismgate-conversation.json", tmp_path / "prismgate-conversation.csv"
    wait_for(lambda: json_file.exists() and csv_file.exists(), timeout=20)

    exported = json.loads(json_file.read_text())
    assert exported["readouts"]["layers"] == list(pack.layers)
    np.testing.assert_allclose(np.array(exported["readouts"]["scales"]), pack.scales, rtol=1e-6)
    tokens = exported["tokens"]
    parts = [(t["turn"], t["part"]) for t in tokens]
    assert parts.count((0, "answer")) == 4 and parts.count((1, "answer")) == 3
    assert parts.count((0, "prompt")) == len(prompt_box.find_elements(By.CSS_SELECTOR, ".tok"))
    assert parts.count((1, "prompt")) > 2  # the second question and the template around it
    positions = [t["position"] for t in tokens]
    assert positions == list(range(len(tokens)))  # the whole session, each position once, in order
    on_page = browser.find_elements(By.CSS_SELECTOR, ".tok[data-value]")
    shown = {int(t.get_attribute("data-position")): float(t.get_attribute("data-value")) for t in on_page}
    layer = int(browser.find_element(By.ID, "layer").get_attribute("value"))
    concept = int(browser.find_element(By.ID, "concept").get_attribute("value"))
    for t in tokens[1:]:
        assert t["values"][layer][concept] == pytest.approx(shown[t["position"]], abs=1e-6)
        assert t["logprob"] is not None and t["logprob"] <= 0

    rows = list(csv.DictReader(io.StringIO(csv_file.read_text())))
    assert len(rows) == len(tokens)
    assert list(rows[0])[:6] == ["turn", "part", "position", "token_id", "token", "logprob"]
    assert len(rows[0]) == 6 + len(pack.layers) * len(pack.concepts)
    name = f"L{pack.layers[layer]}:{pack.concepts[concept]}"
    for row, t in zip(rows, tokens, strict=True):
        assert (int(row["position"]), int(row["token_id"]), row["token"]) == (t["position"], t["tokenId"], t["text"])
        if t["values"] is not None:
            assert float(row[name]) == pytest.approx(t["values"][layer][concept], rel=1e-6)
    assert browser.execute_script("return window.prismgatePlayground.exportJSON()") == json_file.read_text()


def test_prompt_readouts_line_up_with_the_streamed_ones(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    """Scoring the conversation gives, at the answer's positions, the readouts Evergreen streamed."""
    import json

    server, _ = calibrated
    _ask(browser, server, "Tell me about prisms", 6)
    tokens = json.loads(browser.execute_script("return window.prismgatePlayground.exportJSON()"))["tokens"]
    answer = [t for t in tokens if t["part"] == "answer"]
    messages = [
        {"role": "user", "content": "Tell me about prisms"},
        {"role": "assistant", "content": "", "tokens": [t["tokenId"] for t in answer]},
    ]
    scored = httpx.post(server.http_url + "/playground/score", json={"messages": messages}).json()["tokens"]
    by_position = {t["position"]: t for t in scored}
    for t in answer[:-1]:  # the last decoded token is the one a follow-up's rendering may close differently
        again = by_position[t["position"]]
        assert again["tokenId"] == t["tokenId"]
        np.testing.assert_allclose(np.array(again["values"]), np.array(t["values"]), rtol=1e-3, atol=1e-4)


# -- steering: a slider per concept, the steered and unsteered answers side by side ----------------


def _steer(browser, concept: str, scale: int) -> None:  # type: ignore[no-untyped-def]
    """Move a concept's slider the way a drag does: set its value, fire `input`."""
    browser.execute_script(
        "const s = document.querySelector(`#steer-sliders input[data-concept='${arguments[0]}']`);"
        "s.value = String(arguments[1]); s.dispatchEvent(new Event('input'));",
        concept,
        scale,
    )


def test_a_slider_answers_twice_steered_and_unsteered(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    import json

    from selenium.webdriver.common.by import By

    server, pack = calibrated
    browser.set_window_size(1280, 1100)
    browser.get(server.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    assert browser.find_element(By.ID, "steer-summary").text == "off"
    browser.find_element(By.CSS_SELECTOR, "#steering summary").click()  # the section opens on demand
    sliders = browser.find_elements(By.CSS_SELECTOR, "#steer-sliders input.steer")
    assert [s.get_attribute("data-concept") for s in sliders] == list(pack.concepts)
    assert all(s.get_attribute("value") == "0" for s in sliders)
    steer_layer = int(browser.find_element(By.ID, "steer-layer").get_attribute("value"))
    layer, concept, scale = pack.layers.index(steer_layer), 1, 48
    _steer(browser, pack.concepts[concept], scale)
    assert browser.find_element(By.ID, "steer-summary").text == f"{pack.concepts[concept]} +{scale} at L{steer_layer}"

    field = browser.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys("8")
    browser.find_element(By.ID, "prompt").send_keys("Tell me about prisms")
    browser.find_element(By.ID, "send").click()
    wait_for(
        lambda: (
            len(browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done")) == 2
            and browser.find_elements(By.CSS_SELECTOR, ".turn.user.scored")
        )
    )
    assert not browser.find_elements(By.CSS_SELECTOR, ".turn.error, .turn.failed")
    unsteered, steered = browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant")
    assert "steered" not in unsteered.get_attribute("class") and "steered" in steered.get_attribute("class")
    label = steered.find_element(By.CSS_SELECTOR, ".role").get_attribute("textContent")
    assert label == f"steered: {pack.concepts[concept]} +{scale} at L{steer_layer}"
    for box in (unsteered, steered):  # both answers carry their readouts, shaded
        tokens = box.find_elements(By.CSS_SELECTOR, ".tok")
        assert len(tokens) == 8 and all(t.get_attribute("data-value") for t in tokens)
    pixels = _pixels(steered, "steered-answer")
    assert _tinted(pixels, ORANGE) + _tinted(pixels, BLUE) > 100
    _pixels(browser.find_element(By.TAG_NAME, "body"), "steered-page")

    # the spec reached the engine: at every answer position the steered readout of the concept, at
    # the steered layer, is the unsteered one plus the scale (give or take the tiny model's own
    # readouts, a few units at most, since the two answers' tokens may differ)
    tokens = json.loads(browser.execute_script("return window.prismgatePlayground.exportJSON()"))["tokens"]
    plain = [t for t in tokens if t["part"] == "answer"]
    pushed = [t for t in tokens if t["part"] == "steered"]
    assert len(plain) == len(pushed) == 8 and plain[0]["position"] == pushed[0]["position"]
    assert {t["turn"] for t in tokens} == {0}  # one question: the steered answer is its turn's too
    for a, b in zip(plain, pushed, strict=True):
        assert b["values"][layer][concept] - a["values"][layer][concept] == pytest.approx(scale, abs=0.15 * scale)

    # the unsteered answer is what the page answers with every slider at 0, and that shows one answer
    browser.find_element(By.ID, "steer-reset").click()
    browser.find_element(By.ID, "new-chat").click()
    _ask(browser, server, "Tell me about prisms", 8, new_chat=False)
    assert not browser.find_elements(By.CSS_SELECTOR, ".pair, .turn.steered")
    again = json.loads(browser.execute_script("return window.prismgatePlayground.exportJSON()"))["tokens"]
    assert [t["tokenId"] for t in again if t["part"] == "answer"] == [t["tokenId"] for t in plain]


def test_sliders_start_where_the_pack_measured(calibrated_factory, browser) -> None:  # type: ignore[no-untyped-def]
    """A measured pack: one slider starts on, each reaches its concept's range, the layer follows the first moved."""
    from selenium.webdriver.common.by import By

    from prismgate.engines.readouts.pack import SteeringRange

    measured = {"concept0": SteeringRange(1, 4.0, 16.0, 0.4), "concept2": SteeringRange(0, 8.0, 32.0, 1.5)}
    with calibrated_factory(steering=measured) as (server, pack):
        browser.get(server.http_url + "/playground")
        wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        assert browser.find_element(By.ID, "steer-summary").text == "concept2 +8 at L0"
        assert browser.find_element(By.ID, "concept").get_attribute("value") == str(pack.concepts.index("concept2"))
        sliders = {s.get_attribute("data-concept"): s for s in browser.find_elements(By.CSS_SELECTOR, "input.steer")}
        reach = {
            name: (s.get_attribute("min"), s.get_attribute("max"), s.get_attribute("value"))
            for name, s in sliders.items()
        }
        assert reach == {"concept0": ("-16", "16", "0"), "concept1": ("-32", "32", "0"), "concept2": ("-32", "32", "8")}
        _steer(browser, "concept2", 0)
        _steer(browser, "concept0", 5)  # the only slider on: its own measured layer
        assert browser.find_element(By.ID, "steer-summary").text == "concept0 +5 at L1"
        _steer(browser, "concept2", 3)  # a second one joins at the layer already chosen
        assert browser.find_element(By.ID, "steer-summary").text == "concept0 +5, concept2 +3 at L1"
        browser.find_element(By.ID, "prompt").send_keys("Tell me about prisms")
        browser.find_element(By.ID, "send").click()
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done")) == 2)
        assert not browser.find_elements(By.CSS_SELECTOR, ".turn.error, .turn.failed")


def test_steered_turns_leave_the_session_alone(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    """A steered question then a plain one: the second reuses the session's cache, as without steering."""
    from selenium.webdriver.common.by import By

    server, pack = calibrated
    browser.get(server.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    _steer(browser, pack.concepts[0], -32)
    field = browser.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys("6")
    browser.find_element(By.ID, "prompt").send_keys("Tell me about prisms")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done")) == 2)
    _steer(browser, pack.concepts[0], 0)
    field.clear()
    field.send_keys("4")
    browser.find_element(By.ID, "prompt").send_keys("And then?")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done")) == 3)
    second = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant")[-1]
    assert len(browser.find_elements(By.CSS_SELECTOR, ".pair")) == 1  # the second question: one answer
    assert int(second.get_attribute("data-cached-tokens")) > 6
    assert not browser.find_elements(By.CSS_SELECTOR, ".turn.error, .turn.failed")


def test_a_refused_steering_spec_fails_the_steered_answer_alone(live_server, browser) -> None:  # type: ignore[no-untyped-def]
    """The server's refusal (a layer outside the pack) shows in the steered box; the unsteered one answers."""
    from selenium.webdriver.common.by import By

    browser.get(live_server.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    browser.execute_script(
        "const s = document.getElementById('steer-layer'); s.add(new Option('L99', '99')); s.value = '99';"
    )
    _steer(browser, live_server.service.info().readouts.concepts[0], 8)
    browser.find_element(By.ID, "prompt").send_keys("Tell me about prisms")
    browser.find_element(By.ID, "send").click()
    failed = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.steered.failed"))[0]
    assert "steered run ended: 4400" in failed.text and "99" in failed.text, failed.text
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done"))
    wait_for(lambda: not browser.find_element(By.ID, "send").get_attribute("disabled"))
