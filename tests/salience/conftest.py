"""Fixtures for Salience over real gRPC: generated stubs on a real channel to a live server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from prismgate.schemas import salience_images_pb2_grpc, salience_pb2, salience_pb2_grpc
from tests.conftest import TINY_MODEL_ID

pb = salience_pb2


@dataclass
class Client:
    """A channel and the stubs a Salience client uses."""

    channel: grpc.Channel
    salience: salience_pb2_grpc.SalienceStub
    images: salience_images_pb2_grpc.ImageTokensStub

    def open(self, model: str = TINY_MODEL_ID, **call: Any) -> str:
        return str(self.salience.OpenSession(pb.OpenSessionRequest(model=model), **call).session_id)

    def dump(self, session_id: str, **call: Any) -> list[int]:
        return list(self.salience.DumpSession(pb.DumpSessionRequest(session_id=session_id), **call).tokens)

    def generate(self, **fields: Any) -> tuple[list[pb.Token], pb.GenerateDone]:
        """Run one Generate to its end: the Token events, then the Done."""
        metadata = fields.pop("metadata", None)
        events = list(self.salience.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=60))
        assert events and events[-1].WhichOneof("event") == "done", "the stream must end with one Done"
        assert all(e.WhichOneof("event") == "token" for e in events[:-1])
        return [e.token for e in events[:-1]], events[-1].done


def connect(target: str, **options: Any) -> Client:
    channel = grpc.insecure_channel(target, options=list(options.items()))
    return Client(channel, salience_pb2_grpc.SalienceStub(channel), salience_images_pb2_grpc.ImageTokensStub(channel))


@pytest.fixture
def client(live_server: Any) -> Iterator[Client]:
    c = connect(live_server.grpc_target)
    yield c
    c.channel.close()


def rpc_error(fn: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    """The RpcError a call fails with (streams are drained so their status arrives)."""
    try:
        result = fn(*args, **kwargs)
        if hasattr(result, "__next__"):  # a server stream: its status comes at the end
            list(result)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{getattr(fn, '_method', fn)!r} succeeded; expected an error")


def ranges(*pairs: tuple[int, int]) -> list[pb.PositionRange]:
    return [pb.PositionRange(start=a, end=b) for a, b in pairs]


def reflected(target: str, service: str) -> tuple[set[str], list[descriptor_pb2.FileDescriptorProto]]:
    """What server reflection at ``target`` says: the services it lists, and the files that define ``service``."""
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=service),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    files = described.file_descriptor_response.file_descriptor_proto
    return names, [descriptor_pb2.FileDescriptorProto.FromString(b) for b in files]
