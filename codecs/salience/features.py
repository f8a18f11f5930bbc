"""salience.features.v1.Features: the SAE features of a Salience session's timeline.

salience.v1 is frozen and its Token has no room for features, so they are read from the side:
GetFeatures runs a generation of no tokens on the session (the core's ordinary path: the
session held, its standing steering applied, its cached keys and values reused before the
first position asked for) with the features of positions ``[start, end)`` asked for, and
streams them position by position. The counts a client sends are checked before they are
copied out of the request; what they mean (layers, ids, ranges) the core checks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from prismgate.codecs.grpc_guard import closing
from prismgate.codecs.outflow import Outflow
from prismgate.codecs.salience.convert import ORIGIN
from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.errors import invalid
from prismgate.core.events import Event, TokenEvent
from prismgate.core.features import MAX_WATCHED_FEATURES, FeatureManifest, Features, FeatureSpec, check_features
from prismgate.core.service import SessionService
from prismgate.schemas import salience_features_pb2 as pb
from prismgate.schemas import salience_features_pb2_grpc as pb_grpc

MAX_LAYERS = 256  # more layers than any model has: refused before they are read


class FeaturesServicer(pb_grpc.FeaturesServicer):
    def __init__(self, service: SessionService, buffer_bytes: int = 1024 * 1024) -> None:
        self.service = service
        self.buffer_bytes = buffer_bytes  # what a GetFeatures may hold for a slow reader (prismgate.codecs.outflow)

    async def GetFeatureManifest(
        self, request: pb.GetFeatureManifestRequest, context: grpc.aio.ServicerContext
    ) -> pb.FeatureManifest:
        manifest = self.service.info(request.model or None).features
        if manifest is None:
            return pb.FeatureManifest()
        return pb.FeatureManifest(
            layers=manifest.layers, widths=manifest.widths, labelled=[len(labels) for labels in manifest.labels]
        )

    async def GetFeatures(
        self, request: pb.GetFeaturesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PositionFeatures]:
        if len(request.ids) > MAX_WATCHED_FEATURES:
            raise invalid(f"ids: at most {MAX_WATCHED_FEATURES} feature ids, got {len(request.ids)}")
        if len(request.layers) > MAX_LAYERS:
            raise invalid(f"layers: at most {MAX_LAYERS}, got {len(request.layers)}")
        session = await self.service.session(request.session_id)
        info = self.service.info(session.model)
        spec = FeatureSpec(top_k=request.top_k, layers=tuple(request.layers), ids=tuple(request.ids))
        layers = check_features(info.features, info.model_id, spec)
        if not request.start < request.end <= len(session):
            raise invalid(
                f"positions [{request.start}, {request.end}) are not a non-empty range of the session's "
                f"{len(session)} positions"
            )
        ranges = (PositionRange(request.start, request.end),)
        action = GenerateAction(
            append_tokens=(),
            spec=GenerateSpec(max_tokens=0, features=FeatureSpec(spec.top_k, layers, spec.ids, ranges)),
            origin=ORIGIN,
        )
        manifest = info.features
        events = _messages(self.service.generate(request.session_id, action), manifest)
        async with Outflow(events, pb.PositionFeatures.ByteSize, self.buffer_bytes) as messages:
            async for message in messages:
                yield message


async def _messages(
    events: AsyncGenerator[Event, None], manifest: FeatureManifest | None
) -> AsyncIterator[pb.PositionFeatures]:
    async with closing(events):
        async for event in events:
            if isinstance(event, TokenEvent) and event.features is not None:
                yield position_features(event.position, event.id, event.features, manifest)


def position_features(
    position: int, token_id: int, features: Features, manifest: FeatureManifest | None
) -> pb.PositionFeatures:
    """One position's features as the wire writes them (labels from ``manifest``, "" where none)."""
    layers = []
    for i, layer in enumerate(features.layers):
        index = manifest.layers.index(layer) if manifest is not None else -1
        top = [
            pb.Feature(id=f, activation=v, label=(manifest.label(index, f) if manifest is not None else None) or "")
            for f, v in zip(features.ids[i].tolist(), features.values[i].tolist(), strict=True)
        ]
        watched = features.watched[i].tolist() if features.watched is not None else []
        layers.append(pb.LayerFeatures(layer=layer, top=top, watched=watched))
    return pb.PositionFeatures(position=position, token_id=token_id, layers=layers)
