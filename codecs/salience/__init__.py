"""The Salience codec: salience.v1 (stateful generation with readouts) over gRPC.

Also serves the companions ``salience.images.v1.ImageTokens`` (image token counts),
``salience.tokens.v1.Tokens`` (text to ids and back), ``salience.steering.v1.Steering``
(a session's steering for its later Generate calls), ``salience.features.v1.Features`` (the
SAE features of a session's timeline) and ``salience.models.v1.Models`` (the
served models and each one's readout manifest). All run behind the same guard: the
optional bearer token and GatewayError -> status mapping (see
:mod:`prismgate.codecs.grpc_guard`). See docs/salience.md.
"""

from __future__ import annotations

import grpc

from prismgate.codecs.grpc_guard import Guard, add_guarded
from prismgate.codecs.salience.features import FeaturesServicer
from prismgate.codecs.salience.images import ImageTokensServicer
from prismgate.codecs.salience.models import ModelsServicer
from prismgate.codecs.salience.servicer import SalienceServicer
from prismgate.codecs.salience.steering import SteeringServicer
from prismgate.codecs.salience.tokens import TokensServicer
from prismgate.core.service import SessionService
from prismgate.keys import ring_for
from prismgate.schemas import (
    salience_features_pb2_grpc,
    salience_images_pb2_grpc,
    salience_models_pb2_grpc,
    salience_pb2_grpc,
    salience_steering_pb2_grpc,
    salience_tokens_pb2_grpc,
)
from prismgate.settings import Settings

__all__ = [
    "FeaturesServicer",
    "ImageTokensServicer",
    "ModelsServicer",
    "SalienceServicer",
    "SteeringServicer",
    "TokensServicer",
    "add_to_server",
]

PROTOCOL = "salience"


def add_to_server(server: grpc.aio.Server, service: SessionService, settings: Settings) -> list[str]:
    """Register salience.v1.Salience and its companions; return their full names."""
    guard = Guard(service, PROTOCOL, ring_for(settings.security), slow_client_timeout_s=settings.streams.timeout_s)
    return [
        add_guarded(
            server,
            salience_pb2_grpc.add_SalienceServicer_to_server,
            SalienceServicer(service, settings.streams.buffer_bytes),
            guard,
        ),
        add_guarded(
            server, salience_images_pb2_grpc.add_ImageTokensServicer_to_server, ImageTokensServicer(service), guard
        ),
        add_guarded(server, salience_tokens_pb2_grpc.add_TokensServicer_to_server, TokensServicer(service), guard),
        add_guarded(
            server, salience_steering_pb2_grpc.add_SteeringServicer_to_server, SteeringServicer(service), guard
        ),
        add_guarded(server, salience_models_pb2_grpc.add_ModelsServicer_to_server, ModelsServicer(service), guard),
        add_guarded(
            server,
            salience_features_pb2_grpc.add_FeaturesServicer_to_server,
            FeaturesServicer(service, settings.streams.buffer_bytes),
            guard,
        ),
    ]
