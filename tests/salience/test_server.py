"""The server around the codec: bearer token, health, reflection, message limits, TTL, guard."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prismgate.codecs.grpc_guard import Guard, add_guarded
from prismgate.codecs.salience.servicer import SalienceServicer
from prismgate.core.errors import Code, GatewayError
from prismgate.keys import KeyRing
from prismgate.schemas import salience_images_pb2 as images_pb
from prismgate.schemas import salience_pb2 as pb
from prismgate.schemas import salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID
from tests.salience.conftest import Client, connect, rpc_error

SERVICES = ("salience.v1.Salience", "salience.images.v1.ImageTokens")
TOKEN = "s3cret-token"


# -- health and reflection -------------------------------------------------------------


def test_health_reports_serving_for_both_services(client: Client) -> None:
    health = health_pb2_grpc.HealthStub(client.channel)
    for name in SERVICES:
        status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
        assert status == health_pb2.HealthCheckResponse.SERVING, name


def test_reflection_lists_and_describes_the_services(client: Client) -> None:
    database = ProtoReflectionDescriptorDatabase(client.channel)
    services = set(database.get_services())
    assert set(SERVICES) <= services
    pool = DescriptorPool(database)
    salience = pool.FindServiceByName("salience.v1.Salience")
    assert {m.name for m in salience.methods} == {
        "OpenSession",
        "CloseSession",
        "ForkSession",
        "Generate",
        "GetReadoutManifest",
        "DumpSession",
    }
    generate = salience.FindMethodByName("Generate")
    assert generate.server_streaming and not generate.client_streaming
    request = pool.FindMessageTypeByName("salience.v1.GenerateRequest")
    assert request.fields_by_name["images"].number == 14
    counter = pool.FindServiceByName("salience.images.v1.ImageTokens").FindMethodByName("CountImageTokens")
    assert counter.output_type.full_name == "salience.images.v1.CountImageTokensResponse"


# -- the bearer token ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_server(server_factory: Callable[..., Any]) -> Iterator[Any]:
    """Auth on, and a small message limit (64 KiB) so that an oversized request is cheap to send."""
    with server_factory(auth_token=TOKEN, grpc_max_message_bytes=64 * 1024) as server:
        yield server


def every_rpc(client: Client, sid: str, metadata: Any) -> list[tuple[str, Callable[[], Any]]]:
    s, m = client.salience, metadata
    return [
        ("OpenSession", lambda: s.OpenSession(pb.OpenSessionRequest(model=TINY_MODEL_ID), metadata=m)),
        ("CloseSession", lambda: s.CloseSession(pb.CloseSessionRequest(session_id="x"), metadata=m)),
        ("ForkSession", lambda: s.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=0), metadata=m)),
        ("Generate", lambda: list(s.Generate(pb.GenerateRequest(session_id=sid, offset=0), metadata=m))),
        ("GetReadoutManifest", lambda: s.GetReadoutManifest(pb.GetReadoutManifestRequest(), metadata=m)),
        ("DumpSession", lambda: s.DumpSession(pb.DumpSessionRequest(session_id=sid), metadata=m)),
        (
            "CountImageTokens",
            lambda: client.images.CountImageTokens(images_pb.CountImageTokensRequest(image=b"x"), metadata=m),
        ),
    ]


def test_without_the_token_every_rpc_is_unauthenticated(guarded_server: Any) -> None:
    client = connect(guarded_server.grpc_target)
    good = (("authorization", f"Bearer {TOKEN}"),)
    sid = client.open(metadata=good)
    for metadata, needle in [
        (None, "missing"),
        ((("authorization", "Bearer wrong"),), "invalid"),
        ((("authorization", TOKEN),), "invalid"),  # no scheme
    ]:
        for name, call in every_rpc(client, sid, metadata):
            error = rpc_error(call)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
            assert needle in error.details(), name
    assert client.dump(sid, metadata=good) == []  # the failed calls did nothing
    client.channel.close()


def test_with_the_token_every_rpc_works(guarded_server: Any) -> None:
    client = connect(guarded_server.grpc_target)
    good = (("authorization", f"bearer {TOKEN}"),)  # the scheme is case-insensitive
    sid = client.open(metadata=good)
    _, done = client.generate(session_id=sid, append_tokens=[1, 2], offset=0, max_tokens=2, top_k=1, metadata=good)
    assert done.completion_tokens == 2
    for name, call in every_rpc(client, client.open(metadata=good), good):
        if name == "CountImageTokens":  # authenticated, then refused for the text-only model
            assert rpc_error(call).code() == grpc.StatusCode.FAILED_PRECONDITION
        else:
            call()
    client.channel.close()


def test_health_and_reflection_need_no_token(guarded_server: Any) -> None:
    channel = grpc.insecure_channel(guarded_server.grpc_target)
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICES[0]))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICES[0] in set(ProtoReflectionDescriptorDatabase(channel).get_services())
    channel.close()


def test_auth_off_accepts_any_or_no_header(client: Client) -> None:
    client.open()
    client.open(metadata=(("authorization", "Bearer whatever"),))


# -- message size ---------------------------------------------------------------------------


def test_oversized_request_is_resource_exhausted_and_the_server_keeps_serving(guarded_server: Any) -> None:
    client = connect(guarded_server.grpc_target)
    good = (("authorization", f"Bearer {TOKEN}"),)
    sid = client.open(metadata=good)
    # 40000 token ids of two varint bytes each: about 80 KB, over the 64 KiB limit.
    huge = pb.GenerateRequest(session_id=sid, append_tokens=[200] * 40000, offset=0)
    assert huge.ByteSize() > 64 * 1024
    error = rpc_error(lambda: list(client.salience.Generate(huge, metadata=good)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    big_image = images_pb.CountImageTokensRequest(image=b"\0" * (100 * 1024), mime="image/png")
    error = rpc_error(client.images.CountImageTokens, big_image, metadata=good)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The same connection and the server are fine afterwards.
    _, done = client.generate(session_id=sid, append_tokens=[1, 2, 3], offset=0, max_tokens=1, metadata=good)
    assert done.prompt_tokens == 3
    assert client.dump(sid, metadata=good)[:3] == [1, 2, 3]
    client.channel.close()


# -- idle eviction --------------------------------------------------------------------------

TTL_S = 2.0


def test_idle_sessions_are_evicted_and_a_no_op_generate_refreshes(server_factory: Callable[..., Any]) -> None:
    with server_factory(session_ttl_s=TTL_S) as server:
        client = connect(server.grpc_target)
        idle, kept = client.open(), client.open()
        client.generate(session_id=kept, append_tokens=[1, 2], offset=0, max_tokens=0)
        for _ in range(3):  # 3 x 0.8 s: longer than the TTL in total, never idle for a whole TTL
            time.sleep(0.8)
            client.generate(session_id=kept, offset=2)  # empty append, max_tokens 0, no ranges
        error = rpc_error(client.dump, idle)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "evicted" in error.details()
        assert client.dump(kept) == [1, 2]
        time.sleep(TTL_S + 0.5)
        assert rpc_error(client.dump, kept).code() == grpc.StatusCode.NOT_FOUND
        client.channel.close()


# -- the companion service on a text-only model ----------------------------------------------


def test_count_image_tokens_on_a_text_only_model_is_failed_precondition(client: Client) -> None:
    request = images_pb.CountImageTokensRequest(image=b"\x89PNG", mime="image/png")
    error = rpc_error(client.images.CountImageTokens, request)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert TINY_MODEL_ID in error.details() and "no vision encoder" in error.details()
    wrong = images_pb.CountImageTokensRequest(image=b"\x89PNG", mime="image/png", model="other")
    assert (
        rpc_error(client.images.CountImageTokens, wrong).code() == grpc.StatusCode.NOT_FOUND
    )  # unknown model: NOT_FOUND on every wire


# -- the guard: no bare exception reaches a client as UNKNOWN ---------------------------------


class _Failing(SalienceServicer):
    """A servicer whose handlers fail the ways real code can: a bug, a gateway error mid-stream."""

    async def DumpSession(self, request: Any, context: Any) -> Any:
        raise KeyError("the bug")

    async def Generate(self, request: Any, context: Any) -> Any:
        yield pb.GenerateEvent(token=pb.Token(id=1))
        raise GatewayError(Code.UNAVAILABLE, "engine went away")


async def test_exceptions_become_statuses_with_messages(tiny_service: Any) -> None:
    server = grpc.aio.server()
    name = add_guarded(
        server,
        salience_pb2_grpc.add_SalienceServicer_to_server,
        _Failing(tiny_service),
        Guard(tiny_service, "salience", KeyRing(None, None)),
    )
    assert name == "salience.v1.Salience"
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = salience_pb2_grpc.SalienceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.DumpSession(pb.DumpSessionRequest(session_id="s"))
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "KeyError" in caught.value.details() and "the bug" in caught.value.details()

            events = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for event in stub.Generate(pb.GenerateRequest(session_id="s")):
                    events.append(event)
            assert len(events) == 1  # what was sent before the failure still arrives
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert caught.value.details() == "engine went away"
            # And the real handlers still answer through the same guard.
            session = await stub.OpenSession(pb.OpenSessionRequest(model=TINY_MODEL_ID))
            assert session.max_model_len == 512
    finally:
        await server.stop(None)
