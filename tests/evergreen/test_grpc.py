"""evergreen.v2.EvergreenService/StartSession end to end over a real gRPC channel."""

from __future__ import annotations

import grpc
import pytest

from prismgate.schemas import evergreen_generate_pb2 as gpb
from prismgate.schemas import evergreen_pb2 as pb
from prismgate.schemas import evergreen_pb2_grpc


def generate_message(prompt: str, response: str, text: str, max_tokens: int, *children: str) -> pb.SessionMessage:
    message = pb.SessionMessage()
    action = message.actions.add(name="GENERATE")
    action.inputs.add(name="prompt", id=prompt)
    action.outputs.add(name="response", id=response)
    action.outputs.add(name="usage", id=response + "-usage")
    action.configs.add().Pack(gpb.GenerateConfig(max_tokens=max_tokens))
    question = prompt + "-q"
    message.node_fragments.add(id=prompt, child_ids=[*children, question])
    leaf = message.node_fragments.add(id=question)
    leaf.chunk_fragment.metadata.mimetype = "text/plain"
    leaf.chunk_fragment.metadata.role = "user"
    leaf.chunk_fragment.data = text.encode()
    return message


async def test_start_session_streams_two_turns_and_ends_ok(live_server) -> None:
    async with grpc.aio.insecure_channel(live_server.grpc_target) as channel:
        stub = evergreen_pb2_grpc.EvergreenServiceStub(channel)
        call = stub.StartSession()
        await call.write(generate_message("p1", "r1", "Hello", 4))
        fragments: dict[str, list[pb.NodeFragment]] = {}

        async def read_until_final(node_id: str) -> None:
            while True:
                reply = await call.read()
                assert reply is not grpc.aio.EOF
                for f in reply.node_fragments:
                    fragments.setdefault(f.id, []).append(f)
                if any(f.id == node_id and not f.continued for f in reply.node_fragments):
                    return

        await read_until_final("r1-usage")
        r1 = fragments["r1"]
        assert [f.seq for f in r1] == list(range(len(r1))) and not r1[-1].continued
        assert r1[0].chunk_fragment.metadata.mimetype == "text/plain"
        await call.write(generate_message("p2", "r2", "And?", 3, "p1", "r1"))
        await call.done_writing()
        await read_until_final("r2-usage")
        assert await call.read() is grpc.aio.EOF
        assert await call.code() is grpc.StatusCode.OK
        import json

        usage = json.loads(fragments["r2-usage"][0].chunk_fragment.data)
        assert usage["completionTokens"] == 3 and usage["reusedTokens"] > 4


async def test_abort_is_a_status_naming_the_node(live_server) -> None:
    async with grpc.aio.insecure_channel(live_server.grpc_target) as channel:
        stub = evergreen_pb2_grpc.EvergreenServiceStub(channel)
        message = pb.SessionMessage()
        message.node_fragments.add(id="loop", child_ids=["loop"])
        call = stub.StartSession(iter([message]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "'loop'" in info.value.details() and "cycle" in info.value.details()


async def test_incomplete_input_at_half_close_is_failed_precondition(live_server) -> None:
    async with grpc.aio.insecure_channel(live_server.grpc_target) as channel:
        stub = evergreen_pb2_grpc.EvergreenServiceStub(channel)
        message = generate_message("p", "r", "x", 2, "never-sent")
        call = stub.StartSession(iter([message]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "'never-sent'" in info.value.details()


async def test_reflection_lists_the_service(live_server) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(live_server.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for reply in call:
            names = {s.name for s in reply.list_services_response.service}
            assert "evergreen.v2.EvergreenService" in names
            break


def _errors(live_server, code: str) -> float:
    from tests.ops.helpers import scrape, value

    return value(scrape(live_server.http_url), "prismgate_request_errors_total", protocol="evergreen", code=code)


async def test_garbage_on_the_stream_is_invalid_argument_and_counted(live_server) -> None:
    """The shared gRPC guard parses leniently: a message that is not protobuf is named, not CANCELLED."""
    before = _errors(live_server, "INVALID_ARGUMENT")
    async with grpc.aio.insecure_channel(live_server.grpc_target) as channel:
        raw = channel.stream_stream(
            "/evergreen.v2.EvergreenService/StartSession",
            request_serializer=lambda b: b,
            response_deserializer=pb.SessionMessage.FromString,
        )
        call = raw(iter([b"\xff\xff\xff\xff not protobuf"]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in info.value.details()
    assert _errors(live_server, "INVALID_ARGUMENT") == before + 1


async def test_the_guard_checks_the_token_on_evergreen_too(server_factory) -> None:
    with server_factory(auth_token="s3cret") as server:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            stub = evergreen_pb2_grpc.EvergreenServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                # nothing sent: a message racing the abort fails on the client's side as INTERNAL
                async for _ in stub.StartSession(iter(())):
                    pass
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
            good = stub.StartSession(
                iter([generate_message("p", "r", "hi", 2)]), metadata=(("authorization", "Bearer s3cret"),)
            )
            replies = [m async for m in good]
            assert any(f.id == "r" for m in replies for f in m.node_fragments)
