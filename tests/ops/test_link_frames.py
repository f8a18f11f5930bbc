"""The engine host's socket under hostile frames: each bad connection is dropped with a logged reason.

A frame over ``MAX_FRAME``, bytes that are not msgpack, msgpack off the messages' schemas, an
array whose bytes do not match its shape, and a connection that did not join yet sends what
only a peer may: the host closes that connection and logs why, while a joined front-end keeps
generating and the host counts it alone (a side call is no peer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import pytest_asyncio

from prismgate.core.actions import GenerateSpec
from prismgate.core.engine import EngineInfo, EngineRequest
from prismgate.core.errors import GatewayError
from prismgate.core.events import Done, TokenEvent
from prismgate.core.features import Features
from prismgate.workers.wire import (
    ARRAY_EXT,
    HEADER,
    MAX_FRAME,
    BlockingChannel,
    Call,
    Cancel,
    Error,
    Join,
    Message,
    ModelInfo,
    Target,
    Token,
    encode,
    frame,
    unframe,
)
from tests.engines.hosted import HostedEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hosted(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[HostedEngine]:
    engine = HostedEngine(tiny_model_dir, None)
    engine.log = tmp_path_factory.mktemp("host") / "host.log"  # type: ignore[attr-defined]
    saved = os.dup(2)
    with engine.log.open("w") as log:  # type: ignore[attr-defined]
        os.dup2(log.fileno(), 2)  # the host process inherits this stderr: its log lines land in the file
        try:
            await engine.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    yield engine
    await engine.close()


def _raw(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def _bad_array() -> bytes:
    """A Generate whose request holds an array ext of 12 bytes announced as 4 float32 values."""
    ext = msgspec.msgpack.Ext(ARRAY_EXT, msgspec.msgpack.encode(("<f4", (4,), b"\0" * 12)))
    return _raw(msgspec.msgpack.encode([["generate", 1, "tiny-llama", ext, ["", 1.0]]]))


DROPPED = "dropped a connection on the engine host's socket: "


def _bad_spec() -> bytes:
    """A Generate whose request asks for more features than a spec allows (the dataclass's own check)."""
    request = msgspec.to_builtins(EngineRequest(request_id="r", tokens=(1,), spec=GenerateSpec()))
    request["spec"]["features"] = {"top_k": 10**9}
    return _raw(msgspec.msgpack.encode([["generate", 1, "tiny-llama", request, ["", 1.0]]]))


HOSTILE = {
    "over the frame limit": HEADER.pack(MAX_FRAME + 1),
    "not msgpack": _raw(b"\xc1\xc1\xc1\xc1"),
    "an unknown kind": _raw(msgspec.msgpack.encode([["pickle", b"cos\nsystem\n"]])),
    "a request off its schema": _raw(msgspec.msgpack.encode([["generate", 1, "tiny-llama", {"tokens": "x"}, 3]])),
    "an array off its shape": _bad_array(),
    "a spec its dataclass refuses": _bad_spec(),
    "a peer's message without joining": frame([Cancel(1)]),
    "a join, then garbage": frame([Join()]) + _raw(b"\x92\xa4join"),
}


def _send_and_wait_for_close(path: str, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):  # the host closes it: recv returns b"" (a timeout fails the test)
            received += chunk
        return received


def _dropped(log: Path) -> int:
    return log.read_text().count(DROPPED)


async def _generate(hosted: HostedEngine) -> list[object]:
    request = EngineRequest(request_id="after", tokens=(1, 2, 3), spec=GenerateSpec(max_tokens=4, ignore_eos=True))
    return [event async for event in hosted.generate(request)]


@pytest.mark.parametrize("what", list(HOSTILE))
async def test_a_bad_frame_drops_its_connection_only(hosted: HostedEngine, what: str) -> None:
    log: Path = hosted.log  # type: ignore[attr-defined]
    dropped = await asyncio.to_thread(_dropped, log)
    await asyncio.to_thread(_send_and_wait_for_close, hosted._path, HOSTILE[what])
    events = await _generate(hosted)  # the joined front-end never noticed
    assert sum(isinstance(e, TokenEvent) for e in events) == 4 and isinstance(events[-1], Done)
    assert hosted._link is not None and not hosted._link.gone
    for _ in range(200):
        if await asyncio.to_thread(_dropped, log) > dropped:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail(f"the host logged no reason for dropping a connection that sent {what}")


def _side_call(path: str) -> list[Message]:
    """An image-sizing call on a connection of its own, and everything the host sends on it."""
    channel = BlockingChannel(path)
    try:
        args = msgspec.Raw(encode(("tiny-llama", b"\x89PNG", "image/png")))
        channel.send(Call(7, Target.ENGINE, "image_tokens", args))
        return channel.receive()
    finally:
        channel.close()


async def test_arrays_cross_typed_and_intact() -> None:
    readout = np.arange(6, dtype=np.float32).reshape(2, 3)
    features = Features(layers=(1,), ids=[np.array([4, 2], np.int64)], values=[np.array([0.5, 0.25], np.float32)])
    event = TokenEvent(id=5, position=9, is_prefill=False, logprob=-0.5, top_logprobs=[(5, -0.5)], readout=readout,
                       features=features)  # fmt: skip
    (crossed,) = unframe(0, frame([Token(3, event)])[HEADER.size :])
    assert isinstance(crossed, Token) and crossed.call == 3
    got = crossed.event
    assert got.readout is not None and got.readout.dtype == np.float32 and (got.readout == readout).all()
    assert got.features is not None and got.features.ids[0].dtype == np.int64
    assert (got.features.values[0] == features.values[0]).all() and got.top_logprobs == [(5, -0.5)]


async def test_a_models_info_crosses_whole_but_its_tokenizer() -> None:
    engine_fields = {f.name for f in dataclasses.fields(EngineInfo)}
    assert set(ModelInfo.__struct_fields__) == engine_fields - {"tokenizer"} | {"tokenizer_path"}


async def test_a_side_call_is_answered_and_is_no_peer(hosted: HostedEngine) -> None:
    received = await asyncio.to_thread(_side_call, hosted._path)
    # a peer would get the hello and status pushes first; a side call gets its answer only
    assert len(received) == 1 and isinstance(received[0], Error) and received[0].call == 7, received
    assert "engine host" not in received[0].error.message  # the engine's own refusal: the tiny model reads no images
    link = hosted._link
    assert link is not None and link.status is not None and link.status.frontends == 1
    with pytest.raises(GatewayError) as refused:  # the same through the front-end's own side call
        await asyncio.to_thread(link.call_blocking, "image_tokens", ("tiny-llama", b"\x89PNG", "image/png"), int)
    assert refused.value.message == received[0].error.message
