"""Session lifecycle over real gRPC: Open, Close, Fork, Dump, GetReadoutManifest, and their errors."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np

from prismgate.schemas import salience_pb2 as pb
from tests.conftest import TINY_MODEL_ID
from tests.salience.conftest import Client, rpc_error

PROMPT = [10, 20, 30, 40, 50]


def test_open_returns_an_id_and_the_model_context(client: Client, live_server: Any) -> None:
    response = client.salience.OpenSession(pb.OpenSessionRequest(model=TINY_MODEL_ID))
    assert response.session_id
    assert response.max_model_len == live_server.service.info().max_model_len == 512
    assert client.dump(response.session_id) == []
    other = client.open()
    assert other != response.session_id


def test_open_with_the_wrong_model_names_both(client: Client) -> None:
    error = rpc_error(client.salience.OpenSession, pb.OpenSessionRequest(model="gpt-17"))
    assert error.code() == grpc.StatusCode.NOT_FOUND  # an unknown model is NOT_FOUND on every wire
    assert "gpt-17" in error.details() and TINY_MODEL_ID in error.details()


def test_close_is_idempotent_and_the_session_is_gone(client: Client) -> None:
    sid = client.open()
    client.salience.CloseSession(pb.CloseSessionRequest(session_id=sid))
    client.salience.CloseSession(pb.CloseSessionRequest(session_id=sid))
    client.salience.CloseSession(pb.CloseSessionRequest(session_id="never-opened"))
    error = rpc_error(client.salience.DumpSession, pb.DumpSessionRequest(session_id=sid))
    assert error.code() == grpc.StatusCode.NOT_FOUND and sid in error.details()


def test_unknown_session_is_not_found_on_every_session_rpc(client: Client) -> None:
    sid = "0123456789abcdef"
    calls = [
        (client.salience.DumpSession, pb.DumpSessionRequest(session_id=sid)),
        (client.salience.ForkSession, pb.ForkSessionRequest(session_id=sid, at_position=0)),
        (client.salience.Generate, pb.GenerateRequest(session_id=sid, append_tokens=[1], max_tokens=1)),
    ]
    for method, request in calls:
        error = rpc_error(method, request)
        assert error.code() == grpc.StatusCode.NOT_FOUND, method
        assert sid in error.details()


def test_fork_inherits_the_prefix_and_diverges(client: Client) -> None:
    parent = client.open()
    _, done = client.generate(session_id=parent, append_tokens=PROMPT, offset=0, max_tokens=4, top_k=1)
    parent_tokens = client.dump(parent)
    assert len(parent_tokens) == len(PROMPT) + done.completion_tokens

    child = client.salience.ForkSession(pb.ForkSessionRequest(session_id=parent, at_position=3)).session_id
    assert child != parent
    assert client.dump(child) == PROMPT[:3]

    # Diverge: each side appends something different; neither sees the other's turn.
    client.generate(session_id=child, append_tokens=[7, 7], offset=3, max_tokens=0)
    client.generate(session_id=parent, append_tokens=[9], offset=len(parent_tokens), max_tokens=0)
    assert client.dump(child) == [*PROMPT[:3], 7, 7]
    assert client.dump(parent) == [*parent_tokens, 9]

    # Forking at the very end copies everything; closing the parent leaves the fork alive.
    whole = client.salience.ForkSession(pb.ForkSessionRequest(session_id=parent, at_position=len(parent_tokens) + 1))
    client.salience.CloseSession(pb.CloseSessionRequest(session_id=parent))
    assert client.dump(whole.session_id) == [*parent_tokens, 9]


def test_fork_past_the_end_is_failed_precondition(client: Client) -> None:
    sid = client.open()
    client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=0)
    error = rpc_error(client.salience.ForkSession, pb.ForkSessionRequest(session_id=sid, at_position=6))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "6" in error.details() and "5" in error.details()


def test_readout_manifest_is_the_loaded_pack(client: Client, live_server: Any) -> None:
    manifest = client.salience.GetReadoutManifest(pb.GetReadoutManifestRequest())
    pack = live_server.service.info().readouts
    assert list(manifest.concepts) == list(pack.concepts) and len(manifest.concepts) == 3
    assert list(manifest.layers) == list(pack.layers) == [0, 1]
    assert manifest.hidden_size == pack.hidden_size == 128
    assert manifest.dtype == "float32"


def test_dump_is_verbatim_including_ids_above_127(client: Client) -> None:
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 259, size=100)]
    sid = client.open()
    client.generate(session_id=sid, append_tokens=tokens, offset=0, max_tokens=0)
    assert client.dump(sid) == tokens
