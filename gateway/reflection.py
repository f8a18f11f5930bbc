"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcurl, Postman and the newer gRPC tools ask for ``grpc.reflection.v1.ServerReflection``
first and fall back to ``v1alpha`` only on some versions; grpcio-reflection ships only
``v1alpha``. The two services are the same protocol (the ``v1`` proto is the ``v1alpha`` one
under a new package, message for message and field number for field number), so one
servicer answers both: ``v1`` requests are decoded with the ``v1alpha`` message classes,
which read the same bytes. The ``v1`` file is added to the descriptor pool, so that
reflection can describe itself under either name.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PREFIX = ".grpc.reflection.v1alpha."
_V1_PREFIX = ".grpc.reflection.v1."


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """The v1alpha reflection file, renamed to v1."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = V1_FILE
    proto.package = "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(_V1ALPHA_PREFIX):
                field.type_name = _V1_PREFIX + field.type_name[len(_V1ALPHA_PREFIX) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
            method.output_type = method.output_type.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
    return proto


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection for ``service_names`` (and for itself) as v1 and v1alpha."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_v1_file().SerializeToString())
    servicer = reflection.aio.ReflectionServicer([*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME], pool=pool)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
