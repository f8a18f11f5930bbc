"""Fuzzing the GraphPipe decoder: random and mutated buffers never crash, hang or 500 without a message.

In process, a few thousand cases go through everything a request meets before a row runs
(verify, decode, bind, config, plan); over a real socket a few hundred more go through the
whole server, which must answer every one and keep serving afterwards.
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
from graphpipe import remote

from prismgate.codecs.graphpipe import wire
from prismgate.codecs.graphpipe.plan import make_plan
from prismgate.core.errors import GatewayError
from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp
from tests.graphpipe.helpers import infer_buffer, metadata_buffer

CONFIG = '{"max_tokens": 2, "logprobs": 2}'


def seeds() -> list[bytes]:
    return [
        metadata_buffer(),
        infer_buffer([np.array(["hello", "wörld"])], ["prompt"], ["text", "tokens", "lengths"], CONFIG),
        infer_buffer(
            [np.array([[1, 2, 3], [4, 5, -1]], dtype=np.int32)], ["tokens"], ["top_logprobs", "readouts"], CONFIG
        ),
        infer_buffer([np.array("scalar")], config='{"max_tokens": 1, "stop": ["a"]}'),
        infer_buffer([np.array([7, 8], dtype=np.int64)], [], ["logprobs", "top_logprob_ids"], CONFIG),
    ]


def mutate(rng: random.Random, buf: bytes) -> bytes:
    data = bytearray(buf)
    kind = rng.randrange(7)
    if kind == 0 or not data:  # random bytes
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 96)))
    if kind == 1:  # flip a few bits
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 2:  # overwrite an aligned 32-bit word (offsets, lengths) with something nasty
        at = rng.randrange(0, max(1, len(data) - 3)) & ~3
        value = rng.choice(
            [0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, len(data), max(0, len(data) - 4), rng.getrandbits(32)]
        )
        data[at : at + 4] = struct.pack("<I", value)[: len(data) - at]
    elif kind == 3:  # truncate
        del data[rng.randrange(len(data)) :]
    elif kind == 4:  # overwrite a 16-bit vtable-sized word
        at = rng.randrange(0, max(1, len(data) - 1)) & ~1
        data[at : at + 2] = struct.pack("<H", rng.choice([0, 2, 3, 4, 0xFFFF, rng.getrandbits(16)]))[: len(data) - at]
    elif kind == 5:  # splice in random bytes
        at = rng.randrange(len(data))
        data[at:at] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 16)))
    else:  # overwrite a 64-bit word (shape dims)
        at = rng.randrange(0, max(1, len(data) - 7)) & ~7
        value = rng.choice([-1, 0, 1, 2**31, 2**62, rng.getrandbits(20)])
        data[at : at + 8] = struct.pack("<q", value)[: len(data) - at]
    return bytes(data)


def cases(n: int, seed: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    base = seeds()
    for _ in range(n):
        buf = rng.choice(base)
        for _ in range(rng.randint(1, 3)):
            buf = mutate(rng, buf)
        yield buf


async def test_decoder_never_fails_without_a_clear_error(tiny_service: Any) -> None:
    started = time.monotonic()
    outcomes = {"ok": 0, "error": 0, "metadata": 0}
    for buf in cases(4000, seed=1234):
        t0 = time.monotonic()
        try:
            call = wire.decode_request(buf)
            if call is None:
                outcomes["metadata"] += 1
                continue
            await make_plan(tiny_service, call, max_batch=256)
            outcomes["ok"] += 1
        except GatewayError as exc:
            assert exc.message, f"empty message for {buf!r}"
            outcomes["error"] += 1
        assert time.monotonic() - t0 < 1.0, f"slow case ({time.monotonic() - t0:.2f}s): {buf!r}"
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"4000 cases took {elapsed:.1f}s"
    # the fuzzer reaches every path: rejected, answered with metadata, and planned for inference
    assert outcomes["error"] > 1000 and outcomes["metadata"] > 50 and outcomes["ok"] > 50, outcomes


@pytest.mark.timeout(120)
def test_server_answers_every_mutated_request_and_keeps_serving(live_server: Any) -> None:
    url = live_server.http_url + "/graphpipe"
    session = requests.Session()
    started = time.monotonic()
    statuses: dict[int, int] = {}
    for buf in cases(200, seed=99):
        reply = session.post(url, data=buf, timeout=30)
        statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
        assert reply.status_code == 200, reply.text[:200]
        try:
            expect_infer = wire.decode_request(buf) is not None
        except GatewayError:
            expect_infer = True  # errors come back as an InferResponse
        if expect_infer:
            response = gp.InferResponse.GetRootAs(reply.content, 0)
            for i in range(response.ErrorsLength()):
                message = response.Errors(i).Message()
                assert message, f"error without a message for {buf!r}"
                assert not message.startswith(b"internal error"), message
            assert response.ErrorsLength() + response.OutputTensorsLength() > 0
        else:
            assert gp.MetadataResponse.GetRootAs(reply.content, 0).InputsLength() == 2
    assert time.monotonic() - started < 90
    # still healthy
    assert session.get(live_server.http_url + "/graphpipe/control/is_alive", timeout=10).text.strip() == "ok"
    [lengths] = remote.execute_multi(url, [np.array(["after the storm"])], [], ["lengths"], '{"max_tokens": 2}')
    assert lengths.tolist() == [2]
