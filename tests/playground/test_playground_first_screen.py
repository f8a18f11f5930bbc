"""The playground's first screen on the embedded model: no setting touched, a question shows steering at work.

The page opens with the concept pack's strongest measured concept steered at its measured layer
and starting scale (``prismgate concepts show`` prints them), shaded by that concept. One question,
asked without touching anything else, must come back twice, and the steered answer must differ
from the unsteered one, read as the concept (its readout over the answer, read back unsteered
through ``/playground/score``, above the unsteered answer's) and stay fluent by the measure the
pack builder used (the unsteered model's mean logprob on it, and no loop: distinct token trigrams). Real Chromium,
real weights: slow.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from prismgate.engines.readouts.pack import ConceptPack
from prismgate.instruments.packs.build import DEFAULT_PACK
from prismgate.instruments.packs.steering_range import MAX_LOGPROB_DROP, MIN_DISTINCT, distinct
from prismgate.playground import first_steered
from tests.conftest import LiveServer, run_server
from tests.playground.test_playground import wait_for

pytestmark = pytest.mark.slow

QUESTION = "Tell me about your job."  # not one of the prompts the builder measured on


@pytest.fixture(scope="module")
def embedded() -> Iterator[LiveServer]:
    """The server as `make serve` starts it: the embedded model and its committed pack."""
    from prismgate.settings import Settings

    values = {"threads": 1, "host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "shutdown_grace_s": 2.0}
    with run_server(Settings.load(values, env={})) as server:
        yield server


def _read_back(server: LiveServer, answer: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answer's tokens as the unsteered model reads them: their logprobs and readouts."""
    ids = [t["tokenId"] for t in answer]
    text = "".join(t["text"] for t in answer)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": text, "tokens": ids}]
    scored = httpx.post(server.http_url + "/playground/score", json={"messages": messages}, timeout=120).json()
    tokens = scored["tokens"]
    start = next(
        i for i in range(len(tokens) - len(ids), -1, -1) if [t["tokenId"] for t in tokens[i : i + len(ids)]] == ids
    )
    return tokens[start : start + len(ids)]


def test_the_first_screen_steers_in_the_concepts_direction_and_stays_fluent(embedded: LiveServer, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    pack = ConceptPack.load(DEFAULT_PACK)
    assert pack.steering, "the embedded pack carries its measured steering"
    concept = first_steered(pack.concepts, pack.steering)
    assert concept is not None
    measured = pack.steering[concept]
    c = pack.concepts.index(concept)

    browser.set_window_size(1280, 1100)
    browser.get(embedded.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1", timeout=180)
    summary = browser.find_element(By.ID, "steer-summary").get_attribute("textContent")
    assert summary == f"{concept} +{measured.scale:g} at L{measured.layer}"
    shaded = browser.find_element(By.ID, "concept").get_attribute("value")
    assert pack.concepts[int(shaded)] == concept  # shaded by the concept it steers

    browser.find_element(By.ID, "prompt").send_keys(QUESTION)
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done")) == 2, timeout=300)
    assert not browser.find_elements(By.CSS_SELECTOR, ".turn.error, .turn.failed")
    tokens = json.loads(browser.execute_script("return window.prismgatePlayground.exportJSON()"))["tokens"]
    plain = [t for t in tokens if t["part"] == "answer"]
    steered = [t for t in tokens if t["part"] == "steered"]
    plain_text, steered_text = ("".join(t["text"] for t in part) for part in (plain, steered))
    assert plain and steered and steered_text != plain_text

    assert pack.centers is not None and pack.scales is not None
    deep = range(len(pack.layers) // 2, len(pack.layers))  # where the builder reads the effect

    def leaning(read: list[dict[str, Any]]) -> float:
        """The concept's mean (value - center) / scale over the answer, at the pack's deeper layers."""
        return float(
            np.mean([(t["values"][li][c] - pack.centers[li, c]) / pack.scales[li, c] for t in read for li in deep])
        )

    plain_read, steered_read = _read_back(embedded, plain), _read_back(embedded, steered)
    moved = leaning(steered_read) - leaning(plain_read)
    # toward the concept by a sixth of a scale at least: 0.197 on a CPU with AVX2 only (its bf16 kernels give
    # another greedy answer), above 0.25 on the CPUs with AVX-512 this was first run on
    assert moved > 0.16, (moved, plain_text, steered_text)
    drop = np.mean([t["logprob"] for t in plain_read]) - np.mean([t["logprob"] for t in steered_read])
    repeats = distinct([t["tokenId"] for t in steered])
    assert drop <= MAX_LOGPROB_DROP and repeats >= MIN_DISTINCT, (drop, repeats, steered_text, plain_text)
