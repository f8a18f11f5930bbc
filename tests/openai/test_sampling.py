"""vLLM's sampling fields on the OpenAI API (the session's tiny-model server, the official client)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

SHORT = 48  # a seeded answer that ends on EOS within this many tokens
PROMPT = "Say something short."
HOT = 2.0  # the tiny random model rarely picks EOS greedily: sample, flat, and find a seed that does


def chat(client: openai.OpenAI, model: str, prompt: str, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], **kwargs)


@pytest.fixture(scope="module")
def eos_seed(client: openai.OpenAI, model: str) -> int:
    """A seed whose answer to PROMPT (at temperature HOT) is at least 2 tokens and then EOS, within SHORT tokens."""
    for seed in range(200):
        r = chat(client, model, PROMPT, max_tokens=SHORT, temperature=HOT, seed=seed)
        if r.choices[0].finish_reason == "stop" and r.usage.completion_tokens >= 3:
            return seed
    pytest.fail("no seed found whose answer ends on EOS: the fixture needs another prompt")


def test_ignore_eos_gives_the_requested_length(client: openai.OpenAI, model: str, eos_seed: int) -> None:
    ask = {"max_tokens": SHORT, "temperature": HOT, "seed": eos_seed}
    plain = chat(client, model, PROMPT, **ask)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < SHORT
    fixed = chat(client, model, PROMPT, **ask, extra_body={"ignore_eos": True})
    assert fixed.choices[0].finish_reason == "length"
    assert fixed.usage.completion_tokens == SHORT
    assert fixed.choices[0].message.content.startswith(plain.choices[0].message.content)
