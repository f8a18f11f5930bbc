"""Hostile Salience requests on a real socket: long lists are refused from their counts, before
they become objects or reach the engine thread, while another client's Generate completes."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from prismgate.core.budget import RequestBudget
from prismgate.schemas import salience_pb2 as pb
from tests.salience.conftest import Client, rpc_error

BUDGET = RequestBudget()


def refused_while_another_generates(client: Client, request: pb.GenerateRequest) -> tuple[grpc.RpcError, float]:
    victim = client.open()
    done: list[pb.GenerateDone] = []
    other = threading.Thread(
        target=lambda: done.append(client.generate(session_id=victim, append_tokens=[1, 2, 3], max_tokens=4)[1])
    )
    other.start()
    started = time.monotonic()
    error = rpc_error(client.salience.Generate, request, timeout=60)
    took = time.monotonic() - started
    other.join(60)
    assert done and done[0].completion_tokens >= 1  # the other client was served
    return error, took


def test_a_million_position_ranges_are_refused_from_their_count(client: Client) -> None:
    sid = client.open()
    million = [pb.PositionRange(start=0, end=1)] * 1_000_000
    request = pb.GenerateRequest(session_id=sid, append_tokens=[1, 2], max_tokens=1, logprobs_ranges=million)
    error, took = refused_while_another_generates(client, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"1000000 logprob ranges; the limit is {BUDGET.max_position_ranges}"
    assert took < 10
    assert client.dump(sid) == []  # refused before anything was appended


def test_readout_ranges_and_stop_ids_have_limits_too(client: Client, live_server: Any) -> None:
    sid = client.open()
    n = BUDGET.max_position_ranges + 1
    many = [pb.PositionRange(start=0, end=1)] * n
    error, _ = refused_while_another_generates(
        client, pb.GenerateRequest(session_id=sid, append_tokens=[1], readout_ranges=many)
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{n} readout ranges" in error.details()
    ids = [3] * (BUDGET.max_stop_token_ids + 1)
    error, _ = refused_while_another_generates(
        client, pb.GenerateRequest(session_id=sid, append_tokens=[1], max_tokens=1, stop_token_ids=ids)
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop token ids; the limit is" in error.details()
