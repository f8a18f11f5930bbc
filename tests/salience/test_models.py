"""salience.models.v1.Models over real gRPC: the served models and each one's readout manifest.

Two models at once are in tests/scale/test_models.py; here one model, reflection, health,
the bearer token and the answers while the model is still loading.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from prismgate.compose import build_engine, build_service
from prismgate.schemas import salience_models_pb2 as models_pb
from prismgate.schemas import salience_models_pb2_grpc
from prismgate.schemas import salience_pb2 as pb
from prismgate.server import Gateway
from tests.conftest import TINY_MODEL_ID, tiny_settings
from tests.salience.conftest import Client, rpc_error

SERVICE = "salience.models.v1.Models"


@pytest.fixture
def models(client: Client) -> salience_models_pb2_grpc.ModelsStub:
    return salience_models_pb2_grpc.ModelsStub(client.channel)


def test_list_models_describes_the_served_model(live_server: Any, models: salience_models_pb2_grpc.ModelsStub) -> None:
    (model,) = models.ListModels(models_pb.ListModelsRequest(), timeout=10).models
    info = live_server.service.info()
    assert model == models_pb.Model(
        name=TINY_MODEL_ID,
        is_default=True,
        state=models_pb.MODEL_STATE_READY,
        engine="transformers",
        max_model_len=info.max_model_len,
        has_concept_pack=True,
        has_steering=True,
        takes_images=False,
    )


def test_manifest_by_name_is_salience_v1s_manifest(client: Client, models: salience_models_pb2_grpc.ModelsStub) -> None:
    v1 = client.salience.GetReadoutManifest(pb.GetReadoutManifestRequest(), timeout=10)
    assert len(v1.concepts) > 0 and len(v1.layers) > 0
    named = models.GetReadoutManifest(models_pb.GetReadoutManifestRequest(model=TINY_MODEL_ID), timeout=10)
    assert isinstance(named, pb.ReadoutManifest) and named == v1
    assert models.GetReadoutManifest(models_pb.GetReadoutManifestRequest(), timeout=10) == v1  # no name: the default
    error = rpc_error(models.GetReadoutManifest, models_pb.GetReadoutManifestRequest(model="gpt-4"), timeout=10)
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details() == f"model 'gpt-4' is not served here; this server serves '{TINY_MODEL_ID}'"


def test_reflection_and_health_offer_the_service(live_server: Any) -> None:
    with grpc.insecure_channel(live_server.grpc_target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert SERVICE in {s.name for s in listed.list_services_response.service}
    files = {
        p.name: p
        for p in map(
            descriptor_pb2.FileDescriptorProto.FromString, described.file_descriptor_response.file_descriptor_proto
        )
    }
    proto = files["salience_models.proto"]
    assert proto.package == "salience.models.v1" and list(proto.dependency) == ["salience.proto"]
    (methods,) = [s.method for s in proto.service]
    assert [(m.name, m.output_type) for m in methods] == [
        ("ListModels", ".salience.models.v1.ListModelsResponse"),
        ("GetReadoutManifest", ".salience.v1.ReadoutManifest"),
    ]
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_while_loading_it_lists_the_model_and_refuses_its_manifest(tiny_model_dir: Path, tiny_pack: Path) -> None:
    """A real gateway whose engine is held before it loads: LOADING, UNAVAILABLE, then READY; the token applies."""
    settings = tiny_settings(tiny_model_dir, tiny_pack, auth_token="s3cret")
    bearer = [("authorization", "Bearer s3cret")]

    async def scenario() -> None:
        engine = build_engine(settings)
        gate = asyncio.Event()
        load = engine.start

        async def held() -> None:
            await gate.wait()
            await load()

        engine.start = held  # type: ignore[method-assign]
        gateway = Gateway(settings, service=build_service(settings, engine=engine))
        await gateway.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
                stub = salience_models_pb2_grpc.ModelsStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ListModels(models_pb.ListModelsRequest(), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

                (loading,) = (await stub.ListModels(models_pb.ListModelsRequest(), metadata=bearer, timeout=10)).models
                assert loading == models_pb.Model(
                    name=TINY_MODEL_ID, is_default=True, state=models_pb.MODEL_STATE_LOADING, reason="model loading"
                )
                for model, code in ((TINY_MODEL_ID, grpc.StatusCode.UNAVAILABLE), ("gpt-4", grpc.StatusCode.NOT_FOUND)):
                    request = models_pb.GetReadoutManifestRequest(model=model)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.GetReadoutManifest(request, metadata=bearer, timeout=10)
                    assert refused.value.code() == code, refused.value

                gate.set()
                await gateway.wait_ready(120)
                (ready,) = (await stub.ListModels(models_pb.ListModelsRequest(), metadata=bearer, timeout=10)).models
                assert ready.state == models_pb.MODEL_STATE_READY and ready.reason == ""
                assert ready.engine == "transformers" and ready.has_concept_pack
                request = models_pb.GetReadoutManifestRequest(model=TINY_MODEL_ID)
                manifest = await stub.GetReadoutManifest(request, metadata=bearer, timeout=10)
                assert list(manifest.concepts) == list(gateway.service.readouts().concepts)
        finally:
            gate.set()
            await gateway.stop()

    asyncio.run(scenario())
