"""salience.models.v1.Models: the served models, and the readout manifest of any of them.

salience.v1 is frozen and its GetReadoutManifest request names no model, so it can only
describe the default one; a gateway serving several models (``[[models]]``) describes the
others here. Which models exist, whether one is ready, and the NOT_FOUND / UNAVAILABLE
answers are the core's (:class:`~prismgate.core.models.Models`); the manifest message is
salience.v1's, filled by the same conversion salience.v1 uses.
"""

from __future__ import annotations

import contextlib

import grpc

from prismgate.codecs.salience import convert
from prismgate.core.engine import EngineInfo
from prismgate.core.errors import GatewayError
from prismgate.core.health import Health, HealthState
from prismgate.core.service import SessionService
from prismgate.schemas import salience_models_pb2 as pb
from prismgate.schemas import salience_models_pb2_grpc as pb_grpc
from prismgate.schemas import salience_pb2

STATES: dict[HealthState, pb.ModelState] = {
    HealthState.LOADING: pb.MODEL_STATE_LOADING,
    HealthState.READY: pb.MODEL_STATE_READY,
    HealthState.FAILED: pb.MODEL_STATE_FAILED,
    HealthState.STOPPING: pb.MODEL_STATE_STOPPING,
}


class ModelsServicer(pb_grpc.ModelsServicer):
    def __init__(self, service: SessionService) -> None:
        self.service = service

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        models = self.service.models
        default = models.default
        return pb.ListModelsResponse(
            models=[
                _model(name, name == default, health, self._loaded(name)) for name, health in models.health().items()
            ]
        )

    async def GetReadoutManifest(
        self, request: pb.GetReadoutManifestRequest, context: grpc.aio.ServicerContext
    ) -> salience_pb2.ReadoutManifest:
        return convert.manifest(self.service.info(request.model or None).readouts)

    def _loaded(self, name: str) -> EngineInfo | None:
        """The model's facts, or None while it loads (a listing answers for every model, loaded or not)."""
        with contextlib.suppress(GatewayError):
            return self.service.info(name)
        return None


def _model(name: str, is_default: bool, health: Health, info: EngineInfo | None) -> pb.Model:
    model = pb.Model(name=name, is_default=is_default, state=STATES[health.state], reason=health.reason)
    if info is not None:
        model.engine = info.engine_name
        model.max_model_len = info.max_model_len
        model.has_concept_pack = info.readouts is not None
        model.has_steering = info.steering and info.readouts is not None
        model.takes_images = info.vision is not None
    return model
