"""salience.features.v1.Features over real gRPC: a session's SAE features, checked against SAELens.

The tiny model with two random TopK SAEs (after layers 0 and 1, labels on the first; see
conftest.py). A session's features must be what SAELens computes from one plain forward pass
of its timeline, equal the OpenAI wire's numbers for the same tokens, follow the session's
standing steering, and leave the session as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prismgate.schemas import salience_features_pb2 as fpb
from prismgate.schemas import salience_features_pb2_grpc, salience_steering_pb2_grpc
from prismgate.schemas import salience_steering_pb2 as steer_pb
from tests.conftest import TINY_MODEL_ID, LiveServer
from tests.sae.test_features_openai import PROMPT, WATCHED, reference
from tests.salience.conftest import Client, connect, reflected, rpc_error

pytest.importorskip("sae_lens", reason="sae-lens is a dev dependency: make setup installs it")


@pytest.fixture
def client(server: LiveServer) -> Iterator[Client]:
    c = connect(server.grpc_target)
    yield c
    c.channel.close()


@pytest.fixture
def features(client: Client) -> salience_features_pb2_grpc.FeaturesStub:
    return salience_features_pb2_grpc.FeaturesStub(client.channel)


def session_with_answer(client: Client, n: int = 4) -> tuple[str, list[int]]:
    session = client.open()
    tokens, _ = client.generate(session_id=session, offset=0, append_tokens=PROMPT, max_tokens=n, top_k=1)
    return session, PROMPT + [t.id for t in tokens if not t.is_prefill]


def get(stub: salience_features_pb2_grpc.FeaturesStub, **fields: Any) -> list[fpb.PositionFeatures]:
    return list(stub.GetFeatures(fpb.GetFeaturesRequest(**fields), timeout=60))


def test_the_manifest_lists_the_saes(features: salience_features_pb2_grpc.FeaturesStub) -> None:
    manifest = features.GetFeatureManifest(fpb.GetFeatureManifestRequest(model=TINY_MODEL_ID))
    assert list(manifest.layers) == [0, 1] and list(manifest.widths) == [256, 256]
    assert list(manifest.labelled) == [128, 0]


def test_a_sessions_features_match_sae_lens_and_leave_it_as_it_was(
    client: Client, features: salience_features_pb2_grpc.FeaturesStub, tiny_model_dir: Path, saes: list[Path]
) -> None:
    session, timeline = session_with_answer(client)
    got = get(features, session_id=session, start=1, end=len(timeline), top_k=4, ids=WATCHED)
    assert [p.position for p in got] == list(range(1, len(timeline)))
    assert [p.token_id for p in got] == timeline[1:]
    acts = reference(tiny_model_dir, saes, timeline)
    for p in got:
        assert [x.layer for x in p.layers] == [0, 1]
        for layer_acts, entry in zip(acts, p.layers, strict=True):
            values, ids = torch.topk(layer_acts[p.position], 4)
            assert [x.id for x in entry.top] == [int(i) for i, v in zip(ids, values, strict=True) if v > 0]
            assert [x.activation for x in entry.top] == pytest.approx(values[values > 0].tolist(), abs=1e-4)
            assert list(entry.watched) == pytest.approx(layer_acts[p.position, WATCHED].tolist(), abs=1e-4)
        assert all(x.label == (f"feature {x.id}" if x.id % 2 == 0 else "") for x in p.layers[0].top)
        assert all(x.label == "" for x in p.layers[1].top)
    assert client.dump(session) == timeline  # read, not changed
    one = get(features, session_id=session, start=3, end=4, top_k=2, layers=[1])
    assert len(one) == 1 and [x.layer for x in one[0].layers] == [1]
    assert [x.id for x in one[0].layers[0].top] == [x.id for x in got[2].layers[1].top[:2]]


def test_they_equal_the_openai_wires_numbers(
    server: LiveServer, client: Client, features: salience_features_pb2_grpc.FeaturesStub
) -> None:
    session, timeline = session_with_answer(client)
    body = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "features": {"top_k": 3, "ids": WATCHED}}  # fmt: skip
    openai = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60).json()
    theirs = openai["choices"][0]["prismgate"]["features"]
    # OpenAI reports each generated token's features at its position: the same four positions
    ours = get(features, session_id=session, start=len(PROMPT), end=len(timeline), top_k=3, ids=WATCHED)
    assert [t["id"] for t in theirs][: len(ours)] == [p.token_id for p in ours]
    for t, p in zip(theirs, ours, strict=False):
        for a, b in zip(t["layers"], p.layers, strict=True):
            assert [x["id"] for x in a["top"]] == [x.id for x in b.top]
            assert [x["activation"] for x in a["top"]] == pytest.approx([x.activation for x in b.top], abs=1e-4)
            assert a["watched"] == pytest.approx(list(b.watched), abs=1e-4)


def test_they_follow_the_sessions_standing_steering(
    client: Client, features: salience_features_pb2_grpc.FeaturesStub
) -> None:
    session, timeline = session_with_answer(client)
    plain = get(features, session_id=session, start=0, end=len(timeline), top_k=4, layers=[1])
    steering = salience_steering_pb2_grpc.SteeringStub(client.channel)
    push = steer_pb.SteeringEntry(concept="concept1", layer=0, scale=60)
    steering.SetSteering(steer_pb.SetSteeringRequest(session_id=session, entries=[push]), timeout=10)
    steered = get(features, session_id=session, start=0, end=len(timeline), top_k=4, layers=[1])
    assert [p.layers[0].top for p in plain] != [p.layers[0].top for p in steered]
    steering.SetSteering(steer_pb.SetSteeringRequest(session_id=session, entries=[]), timeout=10)
    assert get(features, session_id=session, start=0, end=len(timeline), top_k=4, layers=[1]) == plain


def test_bad_requests_are_refused_before_any_work(
    client: Client, features: salience_features_pb2_grpc.FeaturesStub
) -> None:
    session, timeline = session_with_answer(client, n=2)
    n = len(timeline)
    for fields, code, message in [
        (
            {"start": 2, "end": 2, "top_k": 3},
            grpc.StatusCode.INVALID_ARGUMENT,
            f"[2, 2) are not a non-empty range of the session's {n}",
        ),
        ({"start": 0, "end": n + 1, "top_k": 3}, grpc.StatusCode.INVALID_ARGUMENT, "not a non-empty range"),
        ({"start": 0, "end": 2, "top_k": 65}, grpc.StatusCode.INVALID_ARGUMENT, "top_k must be in [0, 64]"),
        ({"start": 0, "end": 2, "top_k": 0}, grpc.StatusCode.INVALID_ARGUMENT, "ask for top_k > 0 or some ids"),
        ({"start": 0, "end": 2, "top_k": 1, "layers": [2]}, grpc.StatusCode.INVALID_ARGUMENT, "layer 2 has no SAE"),
        ({"start": 0, "end": 2, "ids": [256]}, grpc.StatusCode.INVALID_ARGUMENT, "outside the SAE's features [0, 256)"),
        ({"start": 0, "end": 2, "ids": list(range(257))}, grpc.StatusCode.INVALID_ARGUMENT, "at most 256 feature ids"),
        ({"session_id": "nope", "start": 0, "end": 2, "top_k": 1}, grpc.StatusCode.NOT_FOUND, "nope"),
    ]:
        request = fpb.GetFeaturesRequest(**{"session_id": session, **fields})
        error = rpc_error(features.GetFeatures, request)
        assert error.code() is code and message in error.details(), (fields, error.details())
    assert client.dump(session) == timeline


def test_a_model_without_an_sae_refuses(live_server: LiveServer) -> None:
    c = connect(live_server.grpc_target)
    try:
        stub = salience_features_pb2_grpc.FeaturesStub(c.channel)
        assert list(stub.GetFeatureManifest(fpb.GetFeatureManifestRequest()).layers) == []
        session = c.open()
        c.generate(session_id=session, offset=0, append_tokens=PROMPT, max_tokens=0)
        error = rpc_error(stub.GetFeatures, fpb.GetFeaturesRequest(session_id=session, start=0, end=2, top_k=1))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "has no sparse autoencoder" in error.details()
    finally:
        c.channel.close()


def test_reflection_and_health_list_the_service(server: LiveServer) -> None:
    names, (proto,) = reflected(server.grpc_target, "salience.features.v1.Features")
    assert "salience.features.v1.Features" in names
    assert proto.package == "salience.features.v1"
    assert [m.name for m in proto.service[0].method] == ["GetFeatureManifest", "GetFeatures"]
    with grpc.insecure_channel(server.grpc_target) as channel:
        request = health_pb2.HealthCheckRequest(service="salience.features.v1.Features")
        assert (
            health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING
        )
