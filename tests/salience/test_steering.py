"""salience.steering.v1.Steering over real gRPC: a session's steering for its later Generate calls."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from prismgate.schemas import salience_pb2 as pb
from prismgate.schemas import salience_steering_pb2 as steer_pb
from prismgate.schemas import salience_steering_pb2_grpc
from tests.conftest import TINY_MODEL_ID
from tests.salience.conftest import Client, reflected, rpc_error

PROMPT = [5, 17, 42, 99, 7, 3]
PUSH = steer_pb.SteeringEntry(concept="concept1", layer=0, scale=60, positions=steer_pb.POSITIONS_BOTH)


@pytest.fixture
def steering(client: Client) -> salience_steering_pb2_grpc.SteeringStub:
    return salience_steering_pb2_grpc.SteeringStub(client.channel)


def set_steering(
    stub: salience_steering_pb2_grpc.SteeringStub, session: str, *entries: steer_pb.SteeringEntry
) -> list[steer_pb.SteeringEntry]:
    reply = stub.SetSteering(steer_pb.SetSteeringRequest(session_id=session, entries=entries), timeout=10)
    return list(reply.entries)


def greedy(client: Client, session: str, offset: int, append: list[int], n: int = 10, **fields: Any) -> list[int]:
    tokens, _ = client.generate(
        session_id=session, offset=offset, append_tokens=append, max_tokens=n, top_k=1, **fields
    )
    return [t.id for t in tokens if not t.is_prefill]


def unsteered(client: Client) -> list[int]:
    return greedy(client, client.open(), 0, PROMPT)


def test_steering_applies_to_later_generates_until_cleared(
    client: Client, steering: salience_steering_pb2_grpc.SteeringStub
) -> None:
    plain = unsteered(client)
    session = client.open()
    echoed = set_steering(steering, session, PUSH)
    assert [(e.concept, e.layer, e.scale, e.positions) for e in echoed] == [
        ("concept1", 0, 60.0, steer_pb.POSITIONS_BOTH)
    ]
    got = steering.GetSteering(steer_pb.GetSteeringRequest(session_id=session), timeout=10)
    assert list(got.entries) == echoed
    first = greedy(client, session, 0, PROMPT)
    assert first != plain

    # it persists: the next turn is steered too, as a fresh steered session given the same timeline
    timeline = PROMPT + first
    second = greedy(client, session, len(timeline), [], n=6)
    fresh = client.open()
    set_steering(steering, fresh, PUSH)
    assert greedy(client, fresh, 0, timeline, n=6) == second
    assert greedy(client, client.open(), 0, timeline, n=6) != second

    # clearing (the empty list) restores unsteered output
    assert set_steering(steering, session) == []
    assert list(steering.GetSteering(steer_pb.GetSteeringRequest(session_id=session), timeout=10).entries) == []
    assert greedy(client, session, 0, PROMPT, truncating=True) == plain


def test_scale_zero_equals_unsteered(client: Client, steering: salience_steering_pb2_grpc.SteeringStub) -> None:
    session = client.open()  # positions unset: both
    set_steering(steering, session, steer_pb.SteeringEntry(concept="concept1", layer=0, scale=0))
    assert greedy(client, session, 0, PROMPT) == unsteered(client)


def test_equals_the_same_request_steered_over_openai(
    client: Client, steering: salience_steering_pb2_grpc.SteeringStub, live_server: Any
) -> None:
    entry = {"concept": "concept1", "layer": 0, "scale": 60, "positions": "generated"}
    session = client.open()
    generated = steer_pb.SteeringEntry(concept="concept1", layer=0, scale=60, positions=steer_pb.POSITIONS_GENERATED)
    set_steering(steering, session, generated)
    ours = greedy(client, session, 0, PROMPT, n=8)
    body = {"model": TINY_MODEL_ID, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "steering": [entry]}
    r = httpx.post(live_server.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokenizer = live_server.service.info().tokenizer
    assert r.json()["choices"][0]["text"] == tokenizer.decode(ours)
    assert ours != unsteered(client)[:8]


def test_a_raw_direction_and_a_fork_inherit(client: Client, steering: salience_steering_pb2_grpc.SteeringStub) -> None:
    direction = [(-1.0) ** i * (i % 7 + 1) for i in range(128)]  # the tiny model's hidden size
    session = client.open()
    entry = steer_pb.SteeringEntry(direction=direction, layer=0, scale=40, positions=steer_pb.POSITIONS_PROMPT)
    assert list(set_steering(steering, session, entry)[0].direction) == direction
    steered = greedy(client, session, 0, PROMPT)
    assert steered != unsteered(client)
    child = client.salience.ForkSession(pb.ForkSessionRequest(session_id=session, at_position=3)).session_id
    assert list(steering.GetSteering(steer_pb.GetSteeringRequest(session_id=child)).entries) == [entry]
    assert greedy(client, child, 3, PROMPT[3:]) == steered


def test_bad_steering_is_refused_and_leaves_the_session_as_it_was(
    client: Client, steering: salience_steering_pb2_grpc.SteeringStub
) -> None:
    session = client.open()
    set_steering(steering, session, PUSH)
    cases = [
        (steer_pb.SteeringEntry(concept="nope", layer=0, scale=1), "unknown concept 'nope'"),
        (steer_pb.SteeringEntry(concept="concept1", layer=2, scale=1), "layer 2 is not a layer of the concept pack"),
        (steer_pb.SteeringEntry(concept="concept1", layer=0, scale=1e9), "must be in [-256, 256]"),
        (steer_pb.SteeringEntry(concept="concept1", layer=0, scale=5, norm_match=True), "must be in [-4, 4]"),
        (steer_pb.SteeringEntry(direction=[1.0, 2.0], layer=0, scale=1), "hidden size is 128"),
        (steer_pb.SteeringEntry(layer=0, scale=1), "entries[0]: a steering entry names a concept or carries"),
        (steer_pb.SteeringEntry(concept="concept1", direction=[1.0], layer=0, scale=1), "exactly one of the two"),
        (steer_pb.SteeringEntry(concept="concept1", layer=0, scale=1, positions=9), "entries[0].positions"),
    ]
    for entry, message in cases:
        request = steer_pb.SetSteeringRequest(session_id=session, entries=[entry])
        error = rpc_error(steering.SetSteering, request, timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details(), (message, error)
    too_many = steer_pb.SetSteeringRequest(session_id=session, entries=[PUSH] * 9)
    error = rpc_error(steering.SetSteering, too_many, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "9 steering entries; the limit is 8" in error.details()
    assert list(steering.GetSteering(steer_pb.GetSteeringRequest(session_id=session)).entries) == [PUSH]

    for call in (
        lambda: steering.SetSteering(steer_pb.SetSteeringRequest(session_id="nope", entries=[PUSH]), timeout=10),
        lambda: steering.GetSteering(steer_pb.GetSteeringRequest(session_id="nope"), timeout=10),
    ):
        assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND


def test_a_huge_direction_is_refused_while_other_calls_are_served(
    client: Client, steering: salience_steering_pb2_grpc.SteeringStub
) -> None:
    """Eight megabytes of numbers: read off the event loop, then refused for its length."""
    session = client.open()
    huge = steer_pb.SteeringEntry(direction=[0.5] * 1_000_000, layer=0, scale=1)
    pending = steering.SetSteering.future(steer_pb.SetSteeringRequest(session_id=session, entries=[huge]), timeout=60)
    assert greedy(client, client.open(), 0, PROMPT, n=2)  # the server keeps answering meanwhile
    error = rpc_error(pending.result)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "1000000 numbers" in error.details()
    assert list(steering.GetSteering(steer_pb.GetSteeringRequest(session_id=session)).entries) == []


def test_reflection_offers_the_service(live_server: Any) -> None:
    names, (proto,) = reflected(live_server.grpc_target, "salience.steering.v1.Steering")
    assert "salience.steering.v1.Steering" in names
    assert proto.package == "salience.steering.v1"
    assert [m.name for m in proto.service[0].method] == ["SetSteering", "GetSteering"]


def test_a_gated_entry_round_trips_and_gates(client: Client, steering: salience_steering_pb2_grpc.SteeringStub) -> None:
    def gate(threshold: float, comparison: int = steer_pb.COMPARISON_ABOVE) -> steer_pb.Gate:
        return steer_pb.Gate(concept="concept0", layer=0, comparison=comparison, threshold=threshold)

    session = client.open()
    never = steer_pb.SteeringEntry(concept="concept1", layer=1, scale=60, gate=gate(1e30))
    echoed = set_steering(steering, session, never)
    assert echoed == [steer_pb.SteeringEntry(**{**_fields(never), "positions": steer_pb.POSITIONS_BOTH})]
    assert list(steering.GetSteering(steer_pb.GetSteeringRequest(session_id=session), timeout=10).entries) == echoed
    assert greedy(client, session, 0, PROMPT) == unsteered(client)  # a gate that never opens
    always = steer_pb.SteeringEntry(concept="concept1", layer=1, scale=60, gate=gate(1e30, steer_pb.COMPARISON_BELOW))
    session = client.open()
    set_steering(steering, session, always)
    assert greedy(client, session, 0, PROMPT) != unsteered(client)
    for bad, message in [
        (steer_pb.SteeringEntry(concept="concept1", layer=1, scale=1, gate=gate(0.5, 0)), "COMPARISON_ABOVE or"),
        (
            steer_pb.SteeringEntry(
                concept="concept1",
                layer=0,
                scale=1,
                gate=steer_pb.Gate(concept="concept0", layer=1, comparison=steer_pb.COMPARISON_ABOVE),
            ),
            "gate layer 1 comes after",
        ),
        (
            steer_pb.SteeringEntry(concept="concept1", layer=1, scale=1, gate=gate(float("nan"))),
            "must be a finite number",
        ),
    ]:
        error = rpc_error(steering.SetSteering, steer_pb.SetSteeringRequest(session_id=session, entries=[bad]))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and message in error.details(), error.details()


def _fields(entry: steer_pb.SteeringEntry) -> dict[str, Any]:
    return {f.name: v for f, v in entry.ListFields()}
