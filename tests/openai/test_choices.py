"""``n``: several choices of one prompt, each with its own seed, logprobs and readouts (the official client)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

HOT = 1.5
SEED = 41
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
LOGPROBS = {"logprobs": True, "top_logprobs": 2}
READOUTS = {"readouts": {"layers": [1], "concepts": ["concept0"]}}


def near(a: Any, b: Any) -> bool:
    """Equal, numbers to float32 noise: choices decode batched together, a single request alone (not
    deterministic requests, so the last bits may differ)."""
    return bool(a == pytest.approx(b, rel=1e-4, abs=1e-4))


def flat(value: Any) -> Any:
    """Pydantic models as plain data, so that :func:`near` can walk them."""
    if hasattr(value, "model_dump"):
        return flat(value.model_dump())
    if isinstance(value, dict):
        return {k: flat(v) for k, v in value.items()}
    if isinstance(value, list):
        return [flat(v) for v in value]
    return value


def chat(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("seed", SEED)
    kwargs.setdefault("messages", MESSAGES)
    return client.chat.completions.create(model=model, max_tokens=12, temperature=HOT, **kwargs)


def test_choice_i_is_the_request_with_seed_plus_i(client: openai.OpenAI, model: str) -> None:
    many = chat(client, model, n=3, **LOGPROBS, extra_body=READOUTS)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [chat(client, model, **LOGPROBS, seed=SEED + i, extra_body=READOUTS) for i in range(3)]
    for choice, single in zip(many.choices, singles, strict=True):
        (one,) = single.choices
        assert choice.message.content == one.message.content
        assert choice.finish_reason == one.finish_reason
        lp, one_lp = flat(choice.logprobs)["content"], flat(one.logprobs)["content"]
        assert [t["token"] for t in lp] == [t["token"] for t in one_lp]
        assert all(near(a["logprob"], b["logprob"]) for a, b in zip(lp, one_lp, strict=True))  # its own logprobs
        ro, one_ro = choice.model_extra["prismgate"]["readouts"], one.model_extra["prismgate"]["readouts"]
        assert [(r["position"], r["id"]) for r in ro] == [(r["position"], r["id"]) for r in one_ro]
        assert all(near(a["values"][0], b["values"][0]) for a, b in zip(ro, one_ro, strict=True))  # and readouts
    assert len({c.message.content for c in many.choices}) > 1, "seeds SEED..SEED+2 sample differently"
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_streamed_choices_equal_the_non_streamed(client: openai.OpenAI, model: str) -> None:
    whole = chat(client, model, n=3)
    chunks = list(chat(client, model, n=3, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk.id == chunks[0].id and chunk.usage is None
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_sdk_stream_helper_assembles_every_choice(client: openai.OpenAI, model: str) -> None:
    whole = chat(client, model, n=2)
    # the helper assembles the choices, then refuses an answer cut by max_tokens, handing it over
    with (
        pytest.raises(openai.LengthFinishReasonError) as e,
        client.chat.completions.stream(
            model=model, messages=MESSAGES, max_tokens=12, temperature=HOT, seed=SEED, n=2
        ) as stream,
    ):
        stream.get_final_completion()
    final = e.value.completion
    assert [c.message.content for c in final.choices] == [c.message.content for c in whole.choices]


def test_completions_choices(client: openai.OpenAI, model: str) -> None:
    ask = {"model": model, "prompt": "Once upon", "max_tokens": 8, "temperature": HOT, "seed": SEED}
    many = client.completions.create(n=2, logprobs=1, **ask)
    singles = [client.completions.create(**{**ask, "seed": SEED + i}, logprobs=1) for i in range(2)]
    assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
    for choice, single in zip(many.choices, singles, strict=True):
        assert choice.logprobs.tokens == single.choices[0].logprobs.tokens
        assert near(choice.logprobs.token_logprobs, single.choices[0].logprobs.token_logprobs)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(n=2, stream=True, **ask):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[0], streamed[1]] == [c.text for c in many.choices]


@pytest.mark.parametrize(("extra", "param"), [({"n": 17}, "n"), ({"n": 0}, "n")])
def test_n_out_of_range_is_a_400(client: openai.OpenAI, model: str, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, **extra)
    assert e.value.body["param"] == param


def test_n_with_a_session_is_a_400(client: openai.OpenAI, model: str, live_server: Any) -> None:
    import httpx

    sid = httpx.post(live_server.http_url + "/v1/sessions", json={"model": model}).json()["id"]
    try:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, model, n=2, extra_body={"session_id": sid})
        assert e.value.body["param"] == "n"
    finally:
        httpx.delete(f"{live_server.http_url}/v1/sessions/{sid}")


def test_the_choices_share_one_prefill(client: openai.OpenAI, model: str, live_server: Any) -> None:
    from tests.ops import helpers as metrics

    def prefilled() -> float:
        samples = metrics.scrape(live_server.http_url)
        return metrics.value(samples, "prismgate_prompt_prefilled_tokens_total", protocol="openai", model=model)

    before = prefilled()
    many = chat(client, model, n=3, messages=[{"role": "user", "content": "A prompt of its own, prefilled once."}])
    # the first choice prefills the prompt; the others start from a copy of its cache and its last logits
    assert prefilled() - before == many.usage.prompt_tokens


def test_a_choice_the_queue_refuses_refuses_the_request(server_factory: Any, model: str) -> None:
    import httpx

    with server_factory(max_active=1, max_queued=0) as server:
        url = server.http_url + "/v1/chat/completions"
        body = {"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        long = {**body, "max_tokens": 400, "ignore_eos": True}  # a first choice that would run on for a while
        refused = httpx.post(url, json={**long, "n": 2}, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
        # the first choice, already running, was stopped with it: the one slot is free again
        assert httpx.post(url, json=body, timeout=60).status_code == 200
