"""salience.images.v1.ImageTokens: how many image-pad tokens an image becomes.

A companion to salience.v1 so that clients size an image's placeholder run with the
served model's own image processor instead of guessing. The count comes from the core
(:meth:`SessionService.image_tokens`), which decodes the image in a worker thread because a
large image takes long enough to stall every other stream on the event loop.
"""

from __future__ import annotations

import grpc

from prismgate.core.service import SessionService
from prismgate.schemas import salience_images_pb2 as pb
from prismgate.schemas import salience_images_pb2_grpc as pb_grpc


class ImageTokensServicer(pb_grpc.ImageTokensServicer):
    def __init__(self, service: SessionService) -> None:
        self.service = service

    async def CountImageTokens(
        self, request: pb.CountImageTokensRequest, context: grpc.aio.ServicerContext
    ) -> pb.CountImageTokensResponse:
        n, vision = await self.service.image_tokens(request.image, request.mime, request.model or None)
        return pb.CountImageTokensResponse(
            n_pad_tokens=n,
            vision_start_id=vision.vision_start,
            image_pad_id=vision.image_pad,
            vision_end_id=vision.vision_end,
            block_length=n + 2,
        )
