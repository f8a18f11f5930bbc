"""The OpenAI API through the official ``openai`` client, over a real socket to a live gateway."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from prismgate.core.chat import Message, TextPart, render
from tests.ops import helpers as metrics

USER = [{"role": "user", "content": "Hello there"}]


def chat(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, **kwargs)


def stream_chunks(client: openai.OpenAI, model: str, **kwargs: Any) -> list[Any]:
    return list(chat(client, model, stream=True, **kwargs))


# -- models -------------------------------------------------------------------------------------


def test_models_list_and_get(client: openai.OpenAI, model: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].object == "model"
    one = client.models.retrieve(model)
    assert one.id == model and one.owned_by == "prismgate"
    ext = one.model_extra["prismgate"]
    assert ext["max_model_len"] == 512
    assert ext["readouts"]["concepts"] == ["concept0", "concept1", "concept2"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# -- chat -----------------------------------------------------------------------------------------


def test_chat_non_streaming_shape_and_usage(client: openai.OpenAI, model: str, live_server: Any) -> None:
    r = chat(client, model, max_tokens=12)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model
    assert isinstance(r.created, int) and r.created > 1_600_000_000
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None
    prompt = render(live_server.service, [Message("user", [TextPart("Hello there")])])
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(prompt.tokens)
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 12
    assert "prismgate" not in (r.model_extra or {}), "a plain request gets a plain OpenAI response"


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    full = chat(client, model, max_tokens=20)
    chunks = stream_chunks(client, model, max_tokens=20, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(client: openai.OpenAI, model: str) -> None:
    chunks = stream_chunks(client, model, max_tokens=4)
    assert all(c.usage is None and c.choices for c in chunks)


def test_raw_sse_framing(live_server: Any, model: str) -> None:
    """``data: {json}`` events separated by blank lines, ending with ``data: [DONE]``."""
    body = {"model": model, "messages": USER, "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", live_server.http_url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e.strip() and not e.startswith(":")]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    r = chat(client, model, max_tokens=10, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content is not None and len(content) >= 1
    raw = b"".join(bytes(e.bytes or []) for e in content)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy decoding picks the most likely token, and logprobs come from the raw distribution
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].token == entry.token
    if r.choices[0].finish_reason == "length":
        assert len(content) == r.usage.completion_tokens


def test_chat_logprobs_streamed_equal_non_streamed(client: openai.OpenAI, model: str) -> None:
    full = chat(client, model, max_tokens=10, logprobs=True, top_logprobs=2)
    chunks = stream_chunks(client, model, max_tokens=10, logprobs=True, top_logprobs=2)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    expected = full.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-5)


def test_top_logprobs_without_logprobs_is_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    base = chat(client, model, max_tokens=24).choices[0].message.content
    assert base
    # pick a stop string that first occurs after the start of the text
    stop = next((base[i : i + 2] for i in range(2, len(base) - 1) if base.find(base[i : i + 2]) == i), None)
    if stop is None:
        pytest.fail(f"no usable stop string in {base!r}: the test needs a different prompt")
    r = chat(client, model, max_tokens=24, stop=[stop, "never-seen-stop"])
    assert r.choices[0].message.content == base[: base.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in stream_chunks(client, model, max_tokens=24, stop=stop))
    assert streamed == base[: base.index(stop)]


def test_max_completion_tokens_and_max_tokens(client: openai.OpenAI, long_prompt: str, model: str) -> None:
    messages = [{"role": "user", "content": long_prompt}]
    a = chat(client, model, messages=messages, max_completion_tokens=7)
    b = chat(client, model, messages=messages, max_tokens=7)
    for r in (a, b):
        assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    assert a.choices[0].message.content == b.choices[0].message.content


def test_seed_temperature_top_p(client: openai.OpenAI, long_prompt: str, model: str) -> None:
    messages = [{"role": "user", "content": long_prompt}]

    def sample(seed: int) -> str:
        r = chat(client, model, messages=messages, max_tokens=24, temperature=1.5, top_p=0.95, seed=seed)
        return str(r.choices[0].message.content)

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1, "different seeds should sample differently"
    greedy = chat(client, model, messages=messages, max_tokens=24, temperature=0).choices[0].message.content
    assert chat(client, model, messages=messages, max_tokens=24, top_p=0).choices[0].message.content == greedy


def test_content_parts_are_joined(client: openai.OpenAI, model: str) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    a = chat(client, model, messages=[{"role": "user", "content": parts}], max_tokens=8)
    b = chat(client, model, max_tokens=8)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


# -- completions -------------------------------------------------------------------------------------


def test_completions_streaming_and_not(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(b"Once upon a time")  # the test tokenizer is byte-level
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_completions_logprobs_and_token_prompt(client: openai.OpenAI, model: str, live_server: Any) -> None:
    ids = live_server.service.info().tokenizer.encode("abc")
    text_prompt = client.completions.create(model=model, prompt="abc", max_tokens=8, temperature=0, logprobs=2)
    ids_prompt = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, logprobs=2)
    assert text_prompt.choices[0].text == ids_prompt.choices[0].text
    lp = text_prompt.choices[0].logprobs
    n = len(lp.tokens)
    assert n >= 1 and len(lp.token_logprobs) == n and len(lp.top_logprobs) == n and len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) <= 2 and max(top.values()) == pytest.approx(value)
        assert token in top or "\ufffd" in token


def test_completions_echo_with_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="xyz", max_tokens=4, temperature=0, logprobs=1, echo=True)
    text = r.choices[0].text
    assert text.startswith("xyz")
    lp = r.choices[0].logprobs
    assert lp.tokens[:3] == ["x", "y", "z"]
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset[:3] == [0, 1, 2]


# -- readouts extension -----------------------------------------------------------------------------------


def test_readouts_streamed_per_token(client: openai.OpenAI, model: str) -> None:
    chunks = stream_chunks(
        client, model, max_tokens=6, extra_body={"readouts": {"layers": [1], "concepts": ["concept2", "concept0"]}}
    )
    axes = chunks[0].model_extra["prismgate"]["readouts"]
    assert axes == {"layers": [1], "concepts": ["concept2", "concept0"]}
    entries = [
        e
        for c in chunks
        if c.choices and "prismgate" in (c.choices[0].model_extra or {})
        for e in c.choices[0].model_extra["prismgate"]["readouts"]
    ]
    assert entries, "each content chunk carries the readouts of its tokens"
    positions = [e["position"] for e in entries]
    assert positions == sorted(set(positions))
    for e in entries:
        assert len(e["values"]) == 1 and len(e["values"][0]) == 2
        assert all(isinstance(v, float) for v in e["values"][0])


def test_readouts_subset_matches_full(client: openai.OpenAI, model: str) -> None:
    full = chat(client, model, max_tokens=5, extra_body={"readouts": True})
    part = chat(client, model, max_tokens=5, extra_body={"readouts": {"layers": [1], "concepts": ["concept2"]}})
    assert full.model_extra["prismgate"]["readouts"]["layers"] == [0, 1]
    f = full.choices[0].model_extra["prismgate"]["readouts"]
    p = part.choices[0].model_extra["prismgate"]["readouts"]
    assert [e["position"] for e in f] == [e["position"] for e in p] and f
    for a, b in zip(f, p, strict=True):
        assert b["values"] == [[a["values"][1][2]]]


@pytest.mark.parametrize(
    ("readouts", "param"),
    [({"layers": [7]}, "readouts.layers"), ({"concepts": ["nope"]}, "readouts.concepts"), ("all", "readouts")],
)
def test_bad_readouts_are_400(client: openai.OpenAI, model: str, readouts: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, max_tokens=2, extra_body={"readouts": readouts})
    assert e.value.body["param"] == param


# -- errors -----------------------------------------------------------------------------------------


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "gpt-5", max_tokens=2)
    assert e.value.status_code == 404
    assert e.value.body == {
        "message": e.value.body["message"],
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    served = client.models.list().data[0].id
    assert e.value.body["message"] == f"The model 'gpt-5' does not exist; this server serves '{served}'"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x", max_tokens=2)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 17}, "n"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"max_tokens": 4, "extra_body": {"min_tokens": 5}}, "min_tokens"),
        ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
        ({"logit_bias": {"7": -101}}, "logit_bias.7"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ({"stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"extra_body": {"session_id": 5}}, "session_id"),
    ],
)
def test_invalid_chat_requests_are_400_naming_the_field(
    client: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_context_length_exceeded(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, max_tokens=10_000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x" * 600, max_tokens=1)


def test_unknown_fields_are_ignored(client: openai.OpenAI, model: str) -> None:
    plain = chat(client, model, max_tokens=4)
    extra = chat(client, model, max_tokens=4, user="u1", extra_body={"some_future_field": {"x": 1}})
    assert extra.choices[0].message.content == plain.choices[0].message.content


def test_malformed_bodies(live_server: Any, model: str) -> None:
    url = live_server.http_url + "/v1/chat/completions"
    bad_json = httpx.post(url, content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    not_object = httpx.post(url, json=[1, 2])
    assert not_object.status_code == 400 and not_object.json()["error"]["type"] == "invalid_request_error"
    missing_model = httpx.post(url, json={"messages": USER})
    assert missing_model.status_code == 400 and missing_model.json()["error"]["param"] == "model"
    unknown = httpx.post(live_server.http_url + "/v1/embeddings", json={"model": model, "input": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_url"
    # the server is still fine
    ok = httpx.post(url, json={"model": model, "messages": USER, "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_auth(server_factory: Any, model: str) -> None:
    with server_factory(auth_token="s3cret") as srv:
        url = srv.http_url + "/v1"
        with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as e:
                bad.models.list()
            assert e.value.status_code == 401
            with pytest.raises(openai.AuthenticationError):
                bad.chat.completions.create(model=model, messages=USER, max_tokens=1)
        assert httpx.get(url + "/models").status_code == 401
        with openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0) as good:
            assert good.models.list().data[0].id == model
            r = good.chat.completions.create(model=model, messages=USER, max_tokens=2)
            assert r.usage.completion_tokens >= 1


async def test_async_client_streams(live_server: Any, model: str) -> None:
    async with openai.AsyncOpenAI(base_url=live_server.http_url + "/v1", api_key="x", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        full = await c.chat.completions.create(model=model, messages=USER, max_tokens=8, temperature=0)
    assert text == full.choices[0].message.content


def test_streaming_errors_before_the_first_token_are_http_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError):
        chat(client, "gpt-5", max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, max_tokens=10_000, stream=True)
    assert e.value.body["code"] == "context_length_exceeded"


def test_metrics_count_openai_requests(live_server: Any, client: openai.OpenAI, model: str) -> None:
    def count() -> float:
        samples = metrics.scrape(live_server.http_url)
        return metrics.value(samples, "prismgate_requests_total", protocol="openai", model=model)

    before = count()
    chat(client, model, max_tokens=2)
    assert count() == before + 1


def test_images_need_a_vision_model(client: openai.OpenAI, model: str) -> None:
    png = (
        "data:image/png;base64,"
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
    )
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": png}}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert "no images" in e.value.body["message"]


def test_wrong_method_is_405(live_server: Any) -> None:
    r = httpx.get(live_server.http_url + "/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
