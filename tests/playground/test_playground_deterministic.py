"""The playground's side-by-side steering view runs deterministic (real Chromium).

The same steered question sent twice gives the same unsteered answer to the bit (tokens, logprobs,
every readout), and that answer is the one the conversation gets alone, with every slider at 0.
"""

from __future__ import annotations

import json
from typing import Any

from tests.playground.test_playground import _ask, _steer, calibrated, calibrated_factory, wait_for

__all__ = ["calibrated", "calibrated_factory"]  # fixtures used below


def _answers(browser: Any) -> dict[str, list[dict[str, Any]]]:
    tokens = json.loads(browser.execute_script("return window.prismgatePlayground.exportJSON()"))["tokens"]
    keep = ("position", "tokenId", "logprob", "values")
    return {part: [{k: t.get(k) for k in keep} for t in tokens if t["part"] == part] for part in ("answer", "steered")}


def _pair(browser: Any, server: Any, concept: str, scale: int) -> dict[str, list[dict[str, Any]]]:
    from selenium.webdriver.common.by import By

    browser.get(server.http_url + "/playground")
    wait_for(lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    _steer(browser, concept, scale)
    field = browser.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys("8")
    browser.find_element(By.ID, "prompt").send_keys("Tell me about prisms")
    browser.find_element(By.ID, "send").click()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".pair .turn.assistant.done")) == 2)
    assert not browser.find_elements(By.CSS_SELECTOR, ".turn.error, .turn.failed")
    return _answers(browser)


def test_the_unsteered_twin_is_the_answer_alone_every_time(calibrated, browser) -> None:  # type: ignore[no-untyped-def]
    server, pack = calibrated
    first = _pair(browser, server, pack.concepts[1], 48)
    second = _pair(browser, server, pack.concepts[1], 48)
    assert len(first["answer"]) == 8 and all(t["values"] and t["logprob"] is not None for t in first["answer"])
    assert second["answer"] == first["answer"]  # sent twice: the same bits
    assert second["steered"] == first["steered"]
    assert first["steered"] != first["answer"]  # and the steering did change the other one
    _ask(browser, server, "Tell me about prisms", 8)  # no slider moved: one answer, alone
    assert _answers(browser)["answer"] == first["answer"]
