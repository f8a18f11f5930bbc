"""vLLM's sampling fields on the OpenAI API (the session's tiny-model server, the official client)."""

from __future__ import annotations

import base64
import concurrent.futures
from typing import Any

import httpx
import numpy as np
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
    """A seed whose answer to PROMPT (at temperature HOT) is 2 to SHORT // 2 - 1 tokens and then EOS."""
    for seed in range(200):
        r = chat(client, model, PROMPT, max_tokens=SHORT, temperature=HOT, seed=seed)
        if r.choices[0].finish_reason == "stop" and 3 <= r.usage.completion_tokens <= SHORT // 2:
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


def ids_of(response: Any, index: int = 0) -> list[int]:
    """The token ids of a choice asked with ``logprobs`` as base64 (prismgate.logprobs)."""
    coded = response.choices[index].model_extra["prismgate"]["logprobs"]["ids"]
    return np.frombuffer(base64.b64decode(coded), "<i4").tolist()


def greedy(client: openai.OpenAI, model: str, prompt: str, **extra: Any) -> Any:
    """A greedy answer with its token ids (and any extension fields in ``extra``)."""
    body = {"logprobs_encoding_format": "base64", **extra}
    return chat(client, model, prompt, max_tokens=24, logprobs=True, extra_body=body)


def test_min_tokens_holds_eos_back(client: openai.OpenAI, model: str, eos_seed: int) -> None:
    ask = {"max_tokens": SHORT, "temperature": HOT, "seed": eos_seed}
    plain = chat(client, model, PROMPT, **ask)
    at_least = plain.usage.completion_tokens + 4
    held = chat(client, model, PROMPT, **ask, extra_body={"min_tokens": at_least})
    assert held.usage.completion_tokens >= at_least


def test_stop_token_ids_end_the_answer(client: openai.OpenAI, model: str, long_prompt: str, live_server: Any) -> None:
    base = greedy(client, model, long_prompt)
    ids = ids_of(base)
    # a token that first occurs at index 5: the answer ends on it
    cut = next((i for i in range(5, len(ids)) if ids[i] not in ids[:i]), None)
    if cut is None:
        pytest.fail(f"no token of {ids} occurs first after index 5: the test needs another prompt")
    decode = live_server.service.info(model).tokenizer.decode
    stopped = greedy(client, model, long_prompt, stop_token_ids=[ids[cut]])
    assert stopped.choices[0].finish_reason == "stop"
    assert ids_of(stopped) == ids[:cut]  # the stop token is not part of the answer
    assert stopped.choices[0].message.content == decode(ids[:cut])
    assert stopped.usage.completion_tokens == cut + 1
    kept = greedy(client, model, long_prompt, stop_token_ids=[ids[cut]], include_stop_str_in_output=True)
    assert ids_of(kept) == ids[: cut + 1] and kept.choices[0].message.content == decode(ids[: cut + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI, model: str, long_prompt: str) -> None:
    base = str(greedy(client, model, long_prompt).choices[0].message.content)
    stop = next((base[i : i + 2] for i in range(3, len(base) - 1) if base.find(base[i : i + 2]) == i), None)
    if stop is None:
        pytest.fail(f"no usable stop string in {base!r}: the test needs another prompt")
    at = base.index(stop)
    cut = greedy(client, model, long_prompt, stop=[stop])
    kept = greedy(client, model, long_prompt, stop=[stop], include_stop_str_in_output=True)
    assert cut.choices[0].message.content == base[:at]
    assert kept.choices[0].message.content == base[: at + len(stop)]
    assert kept.choices[0].finish_reason == "stop"


def test_min_tokens_defers_stop_strings(client: openai.OpenAI, model: str, long_prompt: str) -> None:
    answer = greedy(client, model, long_prompt)
    base, ids = str(answer.choices[0].message.content), ids_of(answer)
    stop = base[:2]  # matches in the first tokens: with min_tokens it must match only later (or never)
    assert greedy(client, model, long_prompt, stop=[stop]).choices[0].message.content == ""
    later = greedy(client, model, long_prompt, stop=[stop], min_tokens=4)
    assert len(ids_of(later)) >= 4 and ids_of(later) == ids[: len(ids_of(later))]


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}, {"repetition_penalty": 0.1}],
)
def test_penalties_change_a_repetitive_greedy_answer(
    client: openai.OpenAI, model: str, long_prompt: str, penalty: dict[str, float]
) -> None:
    plain = ids_of(greedy(client, model, long_prompt))
    assert len(set(plain)) < len(plain), "the tiny model's greedy answer repeats tokens"
    penalised = ids_of(greedy(client, model, long_prompt, **penalty))
    assert penalised != plain
    # a penalty of repeats repeats less; a repetition penalty below 1 favours them
    favours = penalty.get("repetition_penalty", 2.0) < 1
    assert (len(set(penalised)) <= len(set(plain))) if favours else (len(set(penalised)) >= len(set(plain)))


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, model: str, long_prompt: str) -> None:
    plain = ids_of(greedy(client, model, long_prompt))
    forced = next(t for t in range(40, 120) if t not in plain)
    assert set(ids_of(greedy(client, model, long_prompt, logit_bias={str(forced): 100}))) == {forced}
    banned = ids_of(greedy(client, model, long_prompt, logit_bias={str(plain[0]): -100}))
    assert banned[0] != plain[0] and plain[0] not in banned


def test_token_ids_outside_the_vocabulary_are_a_400(client: openai.OpenAI, model: str) -> None:
    for extra in ({"stop_token_ids": [10**6]}, {"logit_bias": {str(10**6): 1}}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, model, PROMPT, max_tokens=2, extra_body=extra)
        assert "outside the vocabulary" in e.value.body["message"]


def test_min_p_of_one_keeps_only_the_likeliest(client: openai.OpenAI, model: str, long_prompt: str) -> None:
    plain = ids_of(greedy(client, model, long_prompt))
    sampled = [ids_of(greedy(client, model, long_prompt, temperature=HOT, seed=s)) for s in (1, 2)]
    assert any(s != plain for s in sampled), "sampling at HOT differs from greedy"
    for s in (1, 2):
        body = {"logprobs_encoding_format": "base64", "min_p": 1.0}
        r = chat(client, model, long_prompt, max_tokens=24, logprobs=True, temperature=HOT, seed=s, extra_body=body)
        assert ids_of(r) == plain


def test_a_deterministic_request_with_every_field_is_the_same_among_neighbours(
    live_server: Any, model: str, long_prompt: str
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": long_prompt}],
        "max_tokens": 16,
        "temperature": 0.8,
        "seed": 7,
        "deterministic": True,
        "logprobs": True,
        "top_logprobs": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.2,
        "min_p": 0.05,
        "min_tokens": 3,
        "logit_bias": {"65": 2.5},
        "stop_token_ids": [66],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
    }

    def post(payload: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(live_server.http_url + "/v1/chat/completions", json=payload, timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())

    alone = post(body)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        neighbours = [
            pool.submit(post, {**body, "deterministic": False, "messages": [{"role": "user", "content": "x " * i}]})
            for i in range(1, 6)
        ]
        beside = pool.submit(post, body).result()
        assert all(f.result() for f in neighbours)
    assert beside["choices"][0]["logprobs"] == alone["choices"][0]["logprobs"]
    assert beside["choices"][0]["message"] == alone["choices"][0]["message"]
    # choice 1 of two starts from choice 0's prefill and samples with seed 8: the bits of the request seeded 8
    second = post({**body, "seed": 8})
    choices = post({**body, "n": 2})["choices"]
    assert [c["logprobs"] for c in choices] == [alone["choices"][0]["logprobs"], second["choices"][0]["logprobs"]]
