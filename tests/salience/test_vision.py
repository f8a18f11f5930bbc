"""Images over Salience, end to end: a real server on a tiny random Qwen2-VL, real gRPC clients.

The client asks salience.images.v1 how many pad tokens an image becomes, writes the
vision block itself and declares its range, as salience.proto prescribes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from prismgate.core.actions import GenerateAction, GenerateSpec, ImageInput
from prismgate.core.events import TokenEvent
from prismgate.schemas import salience_images_pb2 as images_pb
from prismgate.schemas import salience_pb2 as pb
from tests.salience.conftest import Client, connect, ranges, rpc_error
from tests.vision_model import (
    IM_END,
    IM_START,
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    build_tiny_qwen2_vl,
    image_bytes,
    vision_block,
)

MODEL = "tiny-qwen2-vl"
PNG = "image/png"


@pytest.fixture(scope="module")
def vl_server(server_factory: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("salience-vl") / MODEL)
    with server_factory(model=str(folder), model_name=MODEL, concept_pack="none") as server:
        yield server


@pytest.fixture
def vl(vl_server: Any) -> Iterator[Client]:
    client = connect(vl_server.grpc_target)
    yield client
    client.channel.close()


def count(client: Client, data: bytes, mime: str = PNG) -> images_pb.CountImageTokensResponse:
    return client.images.CountImageTokens(images_pb.CountImageTokensRequest(image=data, mime=mime, model=MODEL))


def attachment(data: bytes, start: int, n: int) -> pb.ImageAttachment:
    return pb.ImageAttachment(bytes=data, mime=PNG, pad_range_start=start, pad_range_end=start + n + 2)


def test_count_image_tokens_follows_the_image_processor(vl: Client) -> None:
    small = count(vl, image_bytes(56, 56))  # one 28x28 cell per token: 2 x 2
    assert small.n_pad_tokens == 4 and small.block_length == 6
    assert (small.vision_start_id, small.image_pad_id, small.vision_end_id) == (VISION_START, IMAGE_PAD, VISION_END)
    assert count(vl, image_bytes(112, 112)).n_pad_tokens == 16  # 4 x 4, the pixel cap
    assert count(vl, image_bytes(112, 56, fmt="JPEG"), "image/jpeg").n_pad_tokens == 8
    empty = images_pb.CountImageTokensRequest(image=image_bytes(56, 56), mime=PNG)  # model may be left out
    assert vl.images.CountImageTokens(empty).n_pad_tokens == 4


def test_count_image_tokens_rejects_bytes_that_are_no_image(vl: Client) -> None:
    error = rpc_error(count, vl, b"not an image at all")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "decoded" in error.details()


async def _core_events(service: Any, action: GenerateAction) -> list[Any]:
    return [e async for e in service.run(action)]


def test_image_conversation_over_grpc(vl: Client, vl_server: Any) -> None:
    first, second = image_bytes(56, 84, seed=1), image_bytes(84, 56, seed=2)
    n1, n2 = count(vl, first).n_pad_tokens, count(vl, second).n_pad_tokens
    sid = vl.open(MODEL)
    mine: list[int] = []

    turn1 = [IM_START, 10, 11, *vision_block(n1), 12, IM_END]
    tokens, done = vl.generate(
        session_id=sid,
        append_tokens=turn1,
        offset=0,
        max_tokens=4,
        top_k=1,
        images=[attachment(first, 3, n1)],
        logprobs_ranges=ranges((len(turn1), len(turn1) + 4)),
    )
    out = [t.id for t in tokens if not t.is_prefill]
    assert done.prompt_tokens == len(turn1) and done.completion_tokens == len(out)
    mine += turn1 + out
    assert vl.dump(sid) == mine

    # The same request run directly on the server's core: the bytes arrived intact.
    action = GenerateAction(
        append_tokens=tuple(turn1),
        images=(ImageInput(first, PNG, 3, 3 + n1 + 2),),
        spec=GenerateSpec(max_tokens=4, temperature=1.0, top_k=1),
    )
    core = [e.id for e in vl_server.call(_core_events(vl_server.service, action)) if isinstance(e, TokenEvent)]
    assert core == out

    # A second image later in the conversation, at a position in the session's timeline.
    start = len(mine) + 2
    turn2 = [IM_START, 20, *vision_block(n2), IM_END]
    _, done = vl.generate(
        session_id=sid,
        append_tokens=turn2,
        offset=len(mine),
        max_tokens=2,
        top_k=1,
        images=[attachment(second, start, n2)],
    )
    assert done.prompt_tokens == len(mine) + len(turn2)
    timeline = vl.dump(sid)
    assert timeline[: len(mine) + len(turn2)] == mine + turn2

    # Fork: never inside an image block; at its boundaries the images come along.
    block = (3, 3 + n1 + 2)
    error = rpc_error(vl.salience.ForkSession, pb.ForkSessionRequest(session_id=sid, at_position=block[0] + 2))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"[{block[0]}, {block[1]})" in error.details()
    child = vl.salience.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=block[1])).session_id
    assert vl.dump(child) == turn1[: block[1]]
    _, done = vl.generate(session_id=child, append_tokens=[13], offset=block[1], max_tokens=1, top_k=1)
    assert done.completion_tokens == 1

    # Truncating into an image block is refused the same way; truncating before it drops it.
    error = rpc_error(vl.generate, session_id=sid, offset=block[0] + 1, truncating=True)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    vl.generate(session_id=sid, offset=block[0], truncating=True)
    assert vl.dump(sid) == turn1[: block[0]]


def test_image_errors_are_invalid_argument(vl: Client) -> None:
    data = image_bytes(56, 56)  # 4 pad tokens
    sid = vl.open(MODEL)
    cases = [
        ([IM_START, *vision_block(5)], [attachment(data, 1, 5)], "expected a range of length 6"),
        ([IM_START, *vision_block(4)], [], "belongs to no declared image"),
        ([IM_START, 7, 7, 7, 7, 7, 7], [attachment(data, 1, 4)], "vision_start"),
        ([IM_START, *vision_block(4)], [attachment(data, 4, 4)], "must lie inside"),
    ]
    for append, images, needle in cases:
        error = rpc_error(vl.generate, session_id=sid, append_tokens=append, offset=0, images=images)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
        assert needle in error.details()
    assert vl.dump(sid) == []


def test_without_a_concept_pack_the_manifest_is_empty_and_readouts_are_refused(vl: Client) -> None:
    assert vl.salience.GetReadoutManifest(pb.GetReadoutManifestRequest()) == pb.ReadoutManifest()
    sid = vl.open(MODEL)
    error = rpc_error(vl.generate, session_id=sid, append_tokens=[1, 2], offset=0, readout_ranges=ranges((0, 2)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "concept pack" in error.details()
