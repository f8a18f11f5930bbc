"""GenerateConfig decoding, and the shared chat rendering the codec relies on (prismgate.core.chat)."""

from __future__ import annotations

import pytest
from google.protobuf import any_pb2, struct_pb2

from prismgate.codecs.evergreen.config import STRUCT_TYPE_URL, parse_configs
from prismgate.core.budget import RequestBudget
from prismgate.core.chat import ImagePart, Message, Prompt, TextPart, render
from prismgate.core.errors import Code, GatewayError
from prismgate.core.prompts import plan_append
from prismgate.core.session import ImageSpan
from prismgate.schemas import evergreen_generate_pb2 as gpb

BUDGET = RequestBudget()


def packed_struct(values: dict) -> any_pb2.Any:
    struct = struct_pb2.Struct()
    struct.update(values)
    out = any_pb2.Any()
    out.Pack(struct)
    assert out.type_url == STRUCT_TYPE_URL
    return out


def test_binary_and_json_configs_mean_the_same() -> None:
    binary = any_pb2.Any()
    binary.Pack(gpb.GenerateConfig(max_tokens=7, temperature=0.5, stop_strings=["\n"]))
    from_json = packed_struct({"maxTokens": 7, "temperature": 0.5, "stop_strings": ["\n"]})
    assert parse_configs([binary], "a", BUDGET) == parse_configs([from_json], "a", BUDGET)
    assert parse_configs([], "a", BUDGET) == gpb.GenerateConfig()


def test_unknown_config_fields_are_errors() -> None:
    with pytest.raises(GatewayError, match="unknown config field 'maxTokenz'"):
        parse_configs([packed_struct({"maxTokenz": 1})], "a", BUDGET)
    binary = any_pb2.Any(type_url="type.googleapis.com/prismgate.evergreen.v1.GenerateConfig", value=b"\xa8\x06\x01")
    with pytest.raises(GatewayError, match=r"unknown field numbers \[101\]"):
        parse_configs([binary], "a", BUDGET)
    with pytest.raises(GatewayError, match="unknown config type"):
        parse_configs([any_pb2.Any(type_url="type.googleapis.com/foo.Bar")], "a", BUDGET)
    with pytest.raises(GatewayError, match="at most one config"):
        parse_configs([packed_struct({}), packed_struct({})], "a", BUDGET)


async def test_render_matches_the_chat_template_and_splices_exact_ids(tiny_service) -> None:
    tokenizer = tiny_service.info().tokenizer
    plain = render(tiny_service.models, [Message("user", [TextPart("Hi "), TextPart("there")])])
    assert list(plain.tokens) == tokenizer.render_chat([{"role": "user", "content": "Hi there"}])
    # an earlier answer with its exact ids (ids that re-tokenising its text would not give back)
    odd_ids = (33, 33, 34)
    convo = [
        Message("user", [TextPart("Hi")]),
        Message("model", [TextPart("?", odd_ids)]),
        Message("user", [TextPart("Q")]),
    ]
    spliced = render(tiny_service.models, convo)
    first_turn = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert list(spliced.tokens[: len(first_turn) + 3]) == first_turn + list(odd_ids)
    as_text = tokenizer.render_chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "?"}, {"role": "user", "content": "Q"}]
    )
    assert len(spliced.tokens) == len(as_text) + 2  # three ids where the text has one; the rest identical
    assert list(spliced.tokens[len(first_turn) + 3 :]) == as_text[len(first_turn) + 1 :]


async def test_images_need_a_vision_model(tiny_service) -> None:
    with pytest.raises(GatewayError) as info:
        render(tiny_service.models, [Message("user", [ImagePart(b"png", "image/png")])])
    assert info.value.code is Code.INVALID_ARGUMENT and "takes no images" in info.value.message


def test_plan_append_keeps_the_longest_shared_prefix() -> None:
    plan = plan_append([1, 2, 3, 4], [], Prompt((1, 2, 3, 4, 5, 6)))
    assert (plan.offset, plan.truncating, plan.tokens) == (4, False, (5, 6))
    plan = plan_append([1, 2, 3, 4], [], Prompt((1, 2, 9)))
    assert (plan.offset, plan.truncating, plan.tokens) == (2, True, (9,))


def test_plan_append_never_cuts_or_reuses_a_different_image() -> None:
    from prismgate.core.actions import ImageInput

    session_image = ImageSpan.of(1, 4, b"cat", "image/png")
    same = ImageInput(b"cat", "image/png", 1, 4)
    other = ImageInput(b"dog", "image/png", 1, 4)
    tokens = (7, 8, 9, 8, 5)
    assert plan_append(list(tokens[:4]), [session_image], Prompt(tokens, (same,))).offset == 4
    plan = plan_append(list(tokens[:4]), [session_image], Prompt(tokens, (other,)))
    assert plan.offset == 1 and plan.truncating and plan.images == (other,)
    plan = plan_append([7, 8, 9], [], Prompt(tokens, (same,)))  # shared prefix ends inside the new block
    assert plan.offset == 1
