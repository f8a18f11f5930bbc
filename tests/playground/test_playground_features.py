"""The playground's SAE features: the manifest, the search endpoint, and in a real Chromium the
features on hover, the search box, and the steer/clamp entries the page sends on the wire."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, run_server, tiny_settings
from tests.playground.test_playground import wait_for
from tests.sae.saes import write_sae

LAYER = 1


@pytest.fixture(scope="module")
def sae_server(tiny_model_dir: Path, tiny_pack: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny model with a random TopK SAE after layer 1 (256 features), the even ids labelled ``feature N``."""
    folder = write_sae(tmp_path_factory.mktemp("sae") / "s", layer=LAYER, k=6, seed=5)
    (folder / "labels.json").write_text(json.dumps({str(i): f"feature {i}" for i in range(0, 256, 2)}))
    with run_server(tiny_settings(tiny_model_dir, tiny_pack, sae=str(folder))) as srv:
        yield srv


def test_the_manifest_describes_the_features(sae_server: LiveServer, live_server: LiveServer) -> None:
    body = httpx.get(sae_server.http_url + "/playground/manifest.json").json()
    assert body["features"] == {
        "layers": [LAYER],
        "widths": [256],
        "labelled": [128],
        "labelsFrom": ["labels.json in the SAE's folder"],
        "topK": 8,
        "maxResults": 50,
    }
    assert httpx.get(live_server.http_url + "/playground/manifest.json").json()["features"] is None


def test_search_by_label_and_by_id(sae_server: LiveServer) -> None:
    def find(**params: str) -> dict:
        response = httpx.get(sae_server.http_url + "/playground/features", params=params)
        assert response.status_code == 200, response.text
        return response.json()

    found = find(q="Feature 12")  # case-insensitive, a label's words
    assert [f["id"] for f in found["features"]] == [12, 120, 122, 124, 126, 128]
    assert found["features"][0] == {"id": 12, "label": "feature 12"} and found["total"] == 6
    by_id = find(q="7", limit="3")  # the id itself first (unlabelled), then labels holding "7"
    assert by_id["features"] == [
        {"id": 7, "label": None},
        {"id": 70, "label": "feature 70"},
        {"id": 72, "label": "feature 72"},
    ]
    assert by_id["total"] > 3 and by_id["layer"] == LAYER
    assert find(q="no such words")["features"] == []
    assert len(find(q="")["features"]) == 20 and find(q="")["total"] == 128


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"q": "x" * 101}, "at most 100"),
        ({"q": "a", "limit": "51"}, "limit must be in [1, 50]"),
        ({"q": "a", "limit": "-1"}, "limit must be a non-negative integer"),
        ({"q": "a", "layer": "0"}, "layer 0 has no SAE"),
        ({"q": "a", "page": "2"}, "unknown parameters ['page']"),
    ],
)
def test_search_refuses_bad_parameters(sae_server: LiveServer, params: dict[str, str], words: str) -> None:
    response = httpx.get(sae_server.http_url + "/playground/features", params=params)
    assert response.status_code == 400 and words in response.json()["error"], response.text


def test_search_on_a_model_without_an_sae(live_server: LiveServer) -> None:
    response = httpx.get(live_server.http_url + "/playground/features", params={"q": "cat"})
    assert response.status_code == 400 and "no sparse autoencoder" in response.json()["error"]


def test_score_carries_the_prompt_tokens_features(sae_server: LiveServer) -> None:
    body = httpx.post(
        sae_server.http_url + "/playground/score", json={"messages": [{"role": "user", "content": "Tell me"}]}
    ).json()
    tokens = body["tokens"]
    assert "layers" not in tokens[0]  # position 0, the attention sink: nothing read
    for t in tokens[1:]:
        (layer,) = t["layers"]
        assert layer["layer"] == LAYER and 0 < len(layer["top"]) <= 8
        for f in layer["top"]:
            assert f["activation"] > 0 and f.get("label") == (f"feature {f['id']}" if f["id"] % 2 == 0 else None)


# -- in the browser ---------------------------------------------------------------------------

RECORD_FRAMES = """
window.sentFrames = [];
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (data) { window.sentFrames.push(String(data)); return send.call(this, data); };
"""


def _open(browser, server: LiveServer) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    browser.set_window_size(1280, 1100)
    browser.get(server.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    browser.execute_script(RECORD_FRAMES)


def _send(browser, prompt: str, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "send").click()


def _generate_configs(browser) -> list[dict]:  # type: ignore[no-untyped-def]
    frames = [json.loads(f) for f in browser.execute_script("return window.sentFrames")]
    return [a["configs"][0]["value"] for f in frames for a in f.get("actions", []) if a["name"] == "GENERATE"]


def test_hovering_a_token_shows_its_features_with_labels(sae_server: LiveServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver import ActionChains
    from selenium.webdriver.common.by import By

    _open(browser, sae_server)
    _send(browser, "Tell me about prisms", 6)
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.assistant.done"))
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.user.scored"))
    (config,) = _generate_configs(browser)
    assert config["features"] == {"topK": 8}
    answer = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok")
    assert len(answer) == 6 and all(int(t.get_attribute("data-features")) > 0 for t in answer)
    prompt = browser.find_elements(By.CSS_SELECTOR, ".turn.user .tok")
    labels, unlabelled = set(), set()
    shown = [t for t in [*prompt[1:], *answer] if t.size["width"] > 0]  # a newline's span has no width to hover
    assert len(shown) > 6
    for token in shown:  # every token but the attention sink lists its features
        ActionChains(browser).move_to_element(token).perform()
        where = f"position {token.get_attribute('data-position')})"
        tip = browser.find_element(By.ID, "tooltip")
        wait_for(lambda: where in tip.text)  # noqa: B023
        assert f"top features at L{LAYER}" in tip.text, tip.text
        for row in tip.find_elements(By.CSS_SELECTOR, "tr.feature"):
            feature = int(row.get_attribute("data-feature"))
            label = row.find_element(By.CSS_SELECTOR, ".label").text
            if feature % 2 == 0:
                assert label == f"feature {feature}"
                labels.add(feature)
            else:
                assert label == "(no label)"
                unlabelled.add(feature)
    assert labels and unlabelled
    source = browser.find_element(By.ID, "feature-source").get_attribute("textContent")
    assert "128 of 256 features labelled, from labels.json in the SAE's folder" in source


def test_search_then_steer_and_clamp_send_the_feature_entries(sae_server: LiveServer, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    _open(browser, sae_server)
    browser.find_element(By.CSS_SELECTOR, "#features summary").click()
    browser.find_element(By.ID, "feature-search").send_keys("feature 12")
    wait_for(lambda: browser.find_element(By.ID, "feature-count").text == "6 found")
    hits = browser.find_elements(By.CSS_SELECTOR, "#feature-results li")
    assert [h.get_attribute("data-feature") for h in hits] == ["12", "120", "122", "124", "126", "128"]
    assert "#12 feature 12" in hits[0].text
    hits[0].find_element(By.CSS_SELECTOR, "button.add-clamp").click()
    search = browser.find_element(By.ID, "feature-search")
    search.clear()
    search.send_keys("7")  # by id: 7 has no label
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#feature-results li[data-feature='7']"))
    browser.find_element(By.CSS_SELECTOR, "#feature-results li[data-feature='7'] button.add-steer").click()
    browser.execute_script(
        "for (const [f, v] of [['12', '3.5'], ['7', '-24']]) {"
        "  const s = document.querySelector(`#feature-controls input[data-feature='${f}']`);"
        "  s.value = v; s.dispatchEvent(new Event('input')); }"
    )
    assert browser.find_element(By.ID, "feature-summary").text == f"#12 = 3.5 at L{LAYER}; #7 -24 at L{LAYER}"

    _send(browser, "Tell me about prisms", 4)
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done"))
    plain, steered = _generate_configs(browser)
    assert "steering" not in plain  # the unsteered answer asks nothing
    assert steered["steering"] == [
        {"feature": 12, "layer": LAYER, "clamp": 3.5},
        {"feature": 7, "layer": LAYER, "scale": -24},
    ]
    assert steered["features"] == plain["features"] == {"topK": 8}
    # the transformers engine steers by feature: the steered answer comes, and nothing is refused
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done.steered"))
    assert not browser.find_elements(By.CSS_SELECTOR, ".turn.steered.failed")
    assert browser.find_element(By.ID, "feature-error").get_attribute("textContent") == ""


def test_a_refused_feature_entry_shows_in_the_panel(sae_server: LiveServer, browser) -> None:  # type: ignore[no-untyped-def]
    """A feature id past the SAE's width: the server refuses it; the unsteered answer still comes."""
    from selenium.webdriver.common.by import By

    _open(browser, sae_server)
    browser.execute_script(f"addFeatureControl(9999, null, {LAYER}, 'clamp')")
    _send(browser, "Tell me about prisms", 4)
    failed = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".turn.steered.failed"))[0]
    assert "steered run ended: 4400" in failed.text, failed.text
    error = browser.find_element(By.ID, "feature-error").get_attribute("textContent")  # in the closed panel
    assert error.startswith("The server refused this feature steering") and "4400" in error, error
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done"))
    assert browser.find_element(By.ID, "features").get_attribute("hidden") is None  # search and reading still work
