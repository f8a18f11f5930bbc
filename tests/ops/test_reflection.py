"""gRPC reflection answers as grpc.reflection.v1 (what grpcurl asks first) and as v1alpha."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2


def v1_classes() -> tuple[Any, Any]:
    """The v1 messages, from the descriptor the server registered (a v1 client compiles the same)."""
    pool = descriptor_pool.Default()
    request = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    response = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse")
    )
    return request, response


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_and_describes_the_services(live_server: Any, version: str) -> None:
    if version == "v1":
        request_cls, response_cls = v1_classes()
    else:
        request_cls, response_cls = reflection_pb2.ServerReflectionRequest, reflection_pb2.ServerReflectionResponse
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        requests = [
            request_cls(list_services=""),
            request_cls(file_containing_symbol="salience.v1.Salience"),
            request_cls(file_containing_symbol=f"grpc.reflection.{version}.ServerReflection"),
        ]
        listed, salience, itself = list(call(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"salience.v1.Salience", "evergreen.v2.EvergreenService", "grpc.health.v1.Health"} <= names
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in salience.file_descriptor_response.file_descriptor_proto
    ]
    assert any(f.package == "salience.v1" for f in files)
    own = [
        descriptor_pb2.FileDescriptorProto.FromString(b) for b in itself.file_descriptor_response.file_descriptor_proto
    ]
    assert [f.package for f in own] == [f"grpc.reflection.{version}"]
