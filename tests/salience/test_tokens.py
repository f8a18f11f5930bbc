"""salience.tokens.v1.Tokens over real gRPC: text to ids with the served tokenizer, and back, within limits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from prismgate.core.chat import Message, TextPart, render
from prismgate.schemas import salience_tokens_pb2 as tokens_pb
from prismgate.schemas import salience_tokens_pb2_grpc
from tests.conftest import TINY_MODEL_ID
from tests.salience.conftest import Client, rpc_error

CONTEXT = 512  # the tiny model's
BYTES_PER_TOKEN = 64  # RequestBudget.prompt_bytes_per_context_token


@pytest.fixture
def tokens(client: Client) -> salience_tokens_pb2_grpc.TokensStub:
    return salience_tokens_pb2_grpc.TokensStub(client.channel)


def test_tokenize_is_the_served_tokenizer_and_round_trips(
    tokens: salience_tokens_pb2_grpc.TokensStub, live_server: Any
) -> None:
    text = "Héllo, wörld: 2 + 2 = 4"
    ids = list(tokens.Tokenize(tokens_pb.TokenizeRequest(text=text, model=TINY_MODEL_ID), timeout=10).ids)
    assert ids == live_server.service.info().tokenizer.encode(text)
    back = tokens.Detokenize(tokens_pb.DetokenizeRequest(ids=ids), timeout=10)
    assert back.text == text
    assert len(back.token_texts) == len(back.token_bytes) == len(ids)
    # the byte-level test tokenizer splits "é" over two ids: only the bytes join up exactly
    assert b"".join(back.token_bytes) == text.encode()
    assert back.token_texts[0] == "H" and "\ufffd" in "".join(back.token_texts)


def test_render_chat_is_what_the_gateway_prompts_with(
    tokens: salience_tokens_pb2_grpc.TokensStub, client: Client, live_server: Any
) -> None:
    messages = [("system", "Be brief."), ("user", "Hi there")]
    request = tokens_pb.RenderChatRequest(
        messages=[tokens_pb.ChatMessage(role=r, content=c) for r, c in messages], add_generation_prompt=True
    )
    ids = list(tokens.RenderChat(request, timeout=10).ids)
    core = [Message(r, [TextPart(c)]) for r, c in messages]
    assert ids == list(render(live_server.service.models, core).tokens)
    request.add_generation_prompt = False
    bare = list(tokens.RenderChat(request, timeout=10).ids)
    assert ids[: len(bare)] == bare and len(ids) > len(bare)
    opening = tokens.Detokenize(tokens_pb.DetokenizeRequest(ids=ids[len(bare) :]), timeout=10).text
    assert opening.endswith("assistant\n")

    # the ids are a Salience prompt as they are
    session = client.open()
    generated, done = client.generate(session_id=session, append_tokens=ids, offset=0, max_tokens=3)
    assert client.dump(session)[: len(ids)] == ids and done.prompt_tokens == len(ids) and generated


@pytest.mark.parametrize(
    ("call", "code", "words"),
    [
        (
            lambda s: s.Tokenize(tokens_pb.TokenizeRequest(text="x" * (CONTEXT * BYTES_PER_TOKEN + 1))),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"over {CONTEXT * BYTES_PER_TOKEN} bytes",
        ),
        (
            lambda s: s.RenderChat(
                tokens_pb.RenderChatRequest(
                    messages=[tokens_pb.ChatMessage(role="user", content="é" * (CONTEXT * BYTES_PER_TOKEN // 2 + 1))]
                )
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "bytes of text",
        ),
        (
            lambda s: s.RenderChat(
                tokens_pb.RenderChatRequest(messages=[tokens_pb.ChatMessage(role="user")] * (CONTEXT + 1))
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{CONTEXT + 1} messages",
        ),
        (
            lambda s: s.RenderChat(tokens_pb.RenderChatRequest(messages=[tokens_pb.ChatMessage(role="wizard")])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown role 'wizard'",
        ),
        (
            lambda s: s.Detokenize(tokens_pb.DetokenizeRequest(ids=[1] * (CONTEXT + 1))),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{CONTEXT + 1} ids",
        ),
        (
            lambda s: s.Detokenize(tokens_pb.DetokenizeRequest(ids=[5, 1 << 30])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the vocabulary",
        ),
        (
            lambda s: s.Tokenize(tokens_pb.TokenizeRequest(text="hi", model="no-such-model")),
            grpc.StatusCode.NOT_FOUND,
            "no-such-model",
        ),
    ],
    ids=["text-bytes", "chat-bytes", "messages", "role", "ids", "vocabulary", "model"],
)
def test_limits_are_checked_with_precise_errors(
    tokens: salience_tokens_pb2_grpc.TokensStub, call: Callable[[Any], Any], code: grpc.StatusCode, words: str
) -> None:
    error = rpc_error(call, tokens)
    assert error.code() == code, error.details()
    assert words in (error.details() or "")


def test_the_bearer_token_applies(server_factory: Callable[..., Any]) -> None:
    with server_factory(auth_token="s3cret") as server, grpc.insecure_channel(server.grpc_target) as channel:
        stub = salience_tokens_pb2_grpc.TokensStub(channel)
        request = tokens_pb.TokenizeRequest(text="hi")
        assert rpc_error(stub.Tokenize, request, timeout=10).code() == grpc.StatusCode.UNAUTHENTICATED
        ids = stub.Tokenize(request, metadata=[("authorization", "Bearer s3cret")], timeout=10).ids
        assert list(ids) == server.service.info().tokenizer.encode("hi")


def test_reflection_offers_the_service(live_server: Any) -> None:
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="salience.tokens.v1.Tokens"),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    assert "salience.tokens.v1.Tokens" in {s.name for s in listed.list_services_response.service}
    (proto,) = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    assert proto.package == "salience.tokens.v1"
    assert [m.name for m in proto.service[0].method] == ["Tokenize", "Detokenize", "RenderChat"]
