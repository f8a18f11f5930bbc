"""A prompt too large for the context is refused from its size, before it is tokenized, while
another client's completion is served; it is OpenAI's 400 ``context_length_exceeded``."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai

from prismgate.core.budget import RequestBudget


def test_a_prompt_bigger_than_the_context_can_hold_is_refused_unread(
    live_server: Any, client: openai.OpenAI, model: str
) -> None:
    context = live_server.service.info().max_model_len
    size = RequestBudget().prompt_bytes_per_context_token * context * 4  # a few hundred KB of text
    served: list[int] = []
    other = threading.Thread(
        target=lambda: served.append(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            ).usage.completion_tokens
        )
    )
    other.start()
    started = time.monotonic()
    for path, body in (
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "a " * (size // 2)}]}),
        ("/v1/completions", {"model": model, "prompt": "a" * size}),
    ):
        reply = httpx.post(live_server.http_url + path, json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "context_length_exceeded" and "bytes of text" in error["message"]
    took = time.monotonic() - started
    other.join(60)
    assert served and served[0] >= 1
    assert took < 10
