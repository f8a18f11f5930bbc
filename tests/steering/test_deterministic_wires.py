"""`deterministic` on every wire, the server default, the core's refusals, and scale-0 steering.

The bits themselves are checked on the real model by tests/engines/test_determinism.py; here each
protocol carries the field to the core (real sockets, the tiny model), the core decides what it
means, and an entry of scale 0 leaves the computation unsteered to the bit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import requests
from google.protobuf import any_pb2, struct_pb2

from prismgate.codecs.evergreen.actions import sampling
from prismgate.codecs.evergreen.config import parse_configs
from prismgate.codecs.salience import convert
from prismgate.core import checks
from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import TokenEvent
from prismgate.core.steering import SteeringEntry
from tests.conftest import TINY_MODEL_ID
from tests.graphpipe.helpers import infer_buffer, read_response
from tests.salience.conftest import connect, rpc_error


def chat(server: Any, content: str, **extra: Any) -> httpx.Response:
    body = {
        "model": TINY_MODEL_ID,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    return httpx.post(server.http_url + "/v1/chat/completions", json=body, timeout=60)


def test_openai_deterministic_request_is_the_same_alone_and_among_neighbours(live_server: Any) -> None:
    alone = chat(live_server, "hello there", deterministic=True)
    assert alone.status_code == 200, alone.text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(chat, live_server, f"neighbour {i} " * (i + 1), max_tokens=24) for i in range(5)]
        beside = pool.submit(chat, live_server, "hello there", deterministic=True).result()
        assert all(f.result().status_code == 200 for f in others)
    assert beside.json()["choices"][0]["logprobs"] == alone.json()["choices"][0]["logprobs"]
    assert beside.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]


def test_openai_deterministic_field_is_checked(live_server: Any) -> None:
    wrong = chat(live_server, "hi", deterministic="yes")
    assert wrong.status_code == 400 and "deterministic" in wrong.text
    unseeded = chat(live_server, "hi", deterministic=True, temperature=0.7)
    assert unseeded.status_code == 400 and "needs a seed" in unseeded.json()["error"]["message"]
    seeded = [chat(live_server, "hi", deterministic=True, temperature=0.7, seed=5).json() for _ in range(2)]
    assert seeded[0]["choices"][0]["logprobs"] == seeded[1]["choices"][0]["logprobs"]


def test_server_default_makes_every_request_deterministic(server_factory: Any) -> None:
    with server_factory(deterministic=True) as server:
        unseeded = chat(server, "hi", temperature=0.7)
        assert unseeded.status_code == 400
        assert "--deterministic" in unseeded.json()["error"]["message"]  # it says where the default came from
        assert chat(server, "hi", temperature=0.7, deterministic=False).status_code == 200
        assert chat(server, "hi").status_code == 200


def test_graphpipe_config_carries_deterministic(live_server: Any) -> None:
    url = live_server.http_url + "/graphpipe"
    rows = [np.array(["hello"])]
    ok = requests.post(url, data=infer_buffer(rows, ["prompt"], ["text"], '{"deterministic": true}'), timeout=60)
    assert ok.status_code == 200 and read_response(ok.content)[1] == []
    bad = requests.post(url, data=infer_buffer(rows, ["prompt"], ["text"], '{"deterministic": 1}'), timeout=60)
    outputs, errors = read_response(bad.content)  # GraphPipe's errors travel in a 200 body
    assert outputs == [] and b"config.deterministic must be true or false" in errors[0]["message"]


def test_evergreen_config_carries_deterministic() -> None:
    struct = struct_pb2.Struct()
    struct.update({"deterministic": True, "temperature": 0.5, "seed": 3})
    packed = any_pb2.Any()
    packed.Pack(struct)
    spec = sampling(parse_configs([packed], "a"))
    assert spec.deterministic is True and spec.seed == 3
    assert sampling(parse_configs([], "a")).deterministic is None  # unset: the server's default


def test_salience_reads_deterministic_and_seed_from_metadata(live_server: Any) -> None:
    client = connect(live_server.grpc_target)
    try:
        fields = {"append_tokens": [1, 2, 3, 4], "offset": 0, "max_tokens": 6, "temperature": 0.8}
        refused = rpc_error(
            client.generate,
            session_id=client.open(),
            metadata=[(convert.DETERMINISTIC_KEY, "true")],
            **fields,
        )
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs a seed" in refused.details()
        seeded = [(convert.DETERMINISTIC_KEY, "true"), (convert.SEED_KEY, "99")]
        runs = [client.generate(session_id=client.open(), metadata=seeded, **fields)[0] for _ in range(2)]
        assert [t.id for t in runs[0]] == [t.id for t in runs[1]]
        bad = rpc_error(
            client.generate, session_id=client.open(), metadata=[(convert.DETERMINISTIC_KEY, "maybe")], **fields
        )
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and convert.DETERMINISTIC_KEY in bad.details()
    finally:
        client.channel.close()


def test_the_core_refuses_deterministic_requests_an_engine_cannot_keep(tiny_service: Any) -> None:
    info = dataclasses.replace(tiny_service.info(), deterministic=False, deterministic_off="set X=1 to allow it")
    with pytest.raises(GatewayError) as caught:
        checks.resolve_deterministic(info, GenerateSpec(deterministic=True), default=False)
    assert caught.value.code is Code.FAILED_PRECONDITION and "set X=1" in caught.value.message
    assert checks.resolve_deterministic(info, GenerateSpec(), default=False).deterministic is False
    assert checks.resolve_deterministic(tiny_service.info(), GenerateSpec(), default=True).deterministic is True


async def collect(service: Any, spec: GenerateSpec, prompt: tuple[int, ...]) -> list[tuple[Any, ...]]:
    out = []
    async for event in service.run(GenerateAction(append_tokens=prompt, spec=spec)):
        if isinstance(event, TokenEvent):
            readout = None if event.readout is None else np.asarray(event.readout, dtype=np.float32).tobytes()
            out.append((event.id, event.logprob, tuple(event.top_logprobs or ()), readout))
    return out


async def test_a_steering_entry_of_scale_zero_is_bit_for_bit_unsteered(tiny_service: Any) -> None:
    manifest = tiny_service.info().readouts
    prompt = (5, 6, 7, 8, 9, 10)
    spec = GenerateSpec(
        max_tokens=6,
        ignore_eos=True,
        logprob_top_k=3,
        logprob_ranges=(PositionRange(1, 12),),
        readout_ranges=(PositionRange(0, 12),),
    )
    zero = SteeringEntry(layer=manifest.layers[0], scale=0.0, concept=manifest.concepts[0])
    plain = await collect(tiny_service, spec, prompt)
    steered = await collect(tiny_service, dataclasses.replace(spec, steering=(zero,)), prompt)
    assert steered == plain
    real = SteeringEntry(layer=manifest.layers[0], scale=3.0, concept=manifest.concepts[0])
    assert await collect(tiny_service, dataclasses.replace(spec, steering=(real,)), prompt) != plain
