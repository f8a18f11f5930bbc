"""Structured outputs on the OpenAI API: ``response_format`` and vLLM's ``structured_outputs``.

The session's tiny model has random weights: left free it writes noise, so every answer that
parses or validates here does so because the grammar's mask held it to the format.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

PROMPT = "Describe a lighthouse as JSON."
# every string bounded by an enum or a pattern, numbers by a range: the answer ends within MAX tokens
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "lit": {"type": "boolean"},
        "floors": {"type": "integer", "minimum": 1, "maximum": 40},
        "colour": {"enum": ["red", "white", "black"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "tags": {"type": "array", "items": {"enum": ["sea", "rock"]}, "maxItems": 3},
    },
    "required": ["lit", "floors", "colour", "code", "tags"],
    "additionalProperties": False,
}
MAX = 120


def ask(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", MAX)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], **kwargs)


def schema_format(schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "lighthouse", "schema": schema, "strict": True}}


def post(server: Any, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=60)


def test_json_schema_answers_validate(client: openai.OpenAI, model: str) -> None:
    free = ask(client, model)
    with pytest.raises(ValueError):  # the same model, unconstrained: not JSON
        json.loads(free.choices[0].message.content or "")
    for seed in range(3):
        r = ask(client, model, temperature=1.5, seed=seed, n=2, response_format=schema_format())
        for choice in r.choices:  # each choice its own matcher
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
        assert r.choices[0].message.content != r.choices[1].message.content


def test_json_object_answers_parse(client: openai.OpenAI, model: str) -> None:
    # free-form JSON objects from random weights can run long: a seed whose object closes in time
    for seed in range(30):
        r = ask(client, model, temperature=1.0, seed=seed, max_tokens=200, response_format={"type": "json_object"})
        text = r.choices[0].message.content or ""
        assert text.startswith("{"), text
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            return
    pytest.fail("no seed gave a JSON object that ended within 200 tokens")


class Lighthouse(pydantic.BaseModel):
    lit: bool
    colour: Literal["red", "white", "black"]
    floors: int = pydantic.Field(ge=1, le=40)


def test_the_sdk_parse_helper_gets_its_pydantic_model(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        response_format=Lighthouse,
        temperature=0,
        max_tokens=MAX,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Lighthouse)
    assert 1 <= parsed.floors <= 40


def test_a_streamed_answer_validates(client: openai.OpenAI, model: str) -> None:
    with client.chat.completions.stream(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        response_format=Lighthouse,
        temperature=0.7,
        seed=3,
        max_tokens=MAX,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3  # it did stream, piece by piece
    assert isinstance(final.choices[0].message.parsed, Lighthouse)
    assert "".join(deltas) == final.choices[0].message.content


def test_choice_and_regex(client: openai.OpenAI, model: str) -> None:
    choices = ["yes", "no", "a lighthouse keeper"]
    seen = set()
    for seed in range(6):
        r = ask(client, model, temperature=1.5, seed=seed, extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices
        seen.add(r.choices[0].message.content)
    assert len(seen) > 1  # a mask, not a constant
    r = ask(client, model, extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2,4}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2,4}", r.choices[0].message.content or "")
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    r = ask(client, model, temperature=1.0, seed=1, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", r.choices[0].message.content or ""), r


def test_text_completions_take_a_schema(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt="A lighthouse:",
        max_tokens=MAX,
        temperature=0,
        extra_body={"response_format": schema_format(), "logprobs": 2},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    assert r.choices[0].logprobs is not None and len(r.choices[0].logprobs.tokens) > 5


def test_readouts_logprobs_and_steering_still_apply(live_server: Any, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX,
        "temperature": 0,
        "response_format": schema_format(),
        "logprobs": True,
        "top_logprobs": 2,
        "readouts": True,
    }
    plain = post(live_server, body)
    assert plain.status_code == 200, plain.text
    steered = post(live_server, {**body, "steering": [{"concept": "concept1", "layer": 0, "scale": 60}]})
    assert steered.status_code == 200, steered.text
    texts = []
    for r in (plain, steered):
        choice = r.json()["choices"][0]
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        tokens = choice["logprobs"]["content"]
        assert tokens and all(len(t["top_logprobs"]) == 2 for t in tokens)
        assert len(choice["prismgate"]["readouts"]) == len(tokens) or "readouts" in json.dumps(choice)
        texts.append(choice["message"]["content"])
    assert texts[0] != texts[1]  # the steering changed the answer, and the grammar still held it


def test_a_deterministic_request_under_a_grammar_is_the_same_among_neighbours(live_server: Any, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX,
        "temperature": 0.9,
        "seed": 11,
        "deterministic": True,
        "logprobs": True,
        "response_format": schema_format(),
    }

    def run(payload: dict[str, Any]) -> dict[str, Any]:
        r = post(live_server, payload)
        assert r.status_code == 200, r.text
        return dict(r.json()["choices"][0])

    alone = run(body)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        neighbours = [
            pool.submit(
                run, {**body, "deterministic": False, "seed": i, "messages": [{"role": "user", "content": "x " * i}]}
            )
            for i in range(1, 6)
        ]
        beside = pool.submit(run, body).result()
        assert all(f.result() for f in neighbours)
    assert beside["message"] == alone["message"]
    assert beside["logprobs"] == alone["logprobs"]
    jsonschema.validate(json.loads(alone["message"]["content"]), SCHEMA)


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "boolean"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


RF, SO = "response_format", "structured_outputs"
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({RF: schema_format({"enum": [f"v{i:06d}" for i in range(4000)]})}, RF, "max_grammar_bytes"),
    ({RF: schema_format(nested(12))}, RF, "max_grammar_depth"),
    ({RF: schema_format({"properties": {"a": {"$ref": "#/$defs/none"}}})}, RF, "invalid json_schema"),
    ({RF: schema_format({"type": 5})}, RF, "invalid json_schema"),
    ({RF: {"type": "json_schema", "json_schema": {"name": "x"}}}, RF, "schema"),
    ({RF: {"type": "grammar"}}, RF, "json_schema"),
    ({SO: {"regex": "(unclosed"}}, SO, "invalid regex"),
    ({SO: {"grammar": "root ::= missing_rule"}}, SO, "invalid grammar"),
    ({SO: {"regex": "a", "choice": ["a"]}}, SO, "exactly one"),
    ({SO: {"choice": ["a"], "structural_tag": "x"}}, SO, "structural_tag"),
    ({SO: {"choice": "a"}}, SO, "array of strings"),
    ({SO: {"json_object": True}, RF: {"type": "json_object"}}, SO, "not both"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_bad_constraints_are_400s_that_say_why(
    live_server: Any, model: str, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, **extra}
    r = post(live_server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    assert error["param"] == param, error
