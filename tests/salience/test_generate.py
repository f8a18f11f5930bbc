"""Generate over real gRPC: turns, prefill-only scoring, logprobs, readouts, stops, and every error."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.events import TokenEvent
from prismgate.schemas import salience_pb2 as pb
from tests.salience.conftest import Client, connect, ranges, rpc_error

Finish = pb.GenerateDone.FinishReason
PROMPT = [1, 2, 3, 4]
GREEDY = {"top_k": 1}  # temperature 0 means 1.0 on this wire, so greedy is top_k = 1


def decoded(tokens: list[pb.Token]) -> list[int]:
    return [t.id for t in tokens if not t.is_prefill]


def test_multi_turn_conversation_matches_the_clients_own_accounting(client: Client) -> None:
    sid = client.open()
    mine: list[int] = []
    turns = [([1, 2, 3, 4], 5), ([60, 61], 3), ([70, 71, 72], 0), ([], 4)]
    for append, max_tokens in turns:
        tokens, done = client.generate(
            session_id=sid, append_tokens=append, offset=len(mine), max_tokens=max_tokens, **GREEDY
        )
        prefix = len(mine) + len(append)
        out = decoded(tokens)
        assert [t.position for t in tokens] == list(range(prefix, prefix + len(out)))
        assert done.prompt_tokens == prefix and done.completion_tokens == len(out)
        assert done.total_tokens == prefix + len(out)
        assert len(out) <= max_tokens
        mine += append + out
        assert client.dump(sid) == mine

    # A deliberate rewrite: rewind three tokens, append, continue.
    offset = len(mine) - 3
    tokens, done = client.generate(
        session_id=sid, append_tokens=[99], offset=offset, truncating=True, max_tokens=2, **GREEDY
    )
    mine = [*mine[:offset], 99, *decoded(tokens)]
    assert done.prompt_tokens == offset + 1
    assert client.dump(sid) == mine


def test_decode_is_deterministic_with_top_k_1_and_reports_length(client: Client) -> None:
    runs = []
    for _ in range(2):
        sid = client.open()
        tokens, done = client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=8, **GREEDY)
        assert done.finish_reason == Finish.FINISH_REASON_LENGTH and done.completion_tokens == 8
        runs.append(decoded(tokens))
    assert runs[0] == runs[1]


def test_default_sampling_runs_and_counts(client: Client) -> None:
    sid = client.open()
    tokens, done = client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=6)
    assert done.completion_tokens == len(decoded(tokens)) <= 6
    assert all(0 <= t < 259 for t in decoded(tokens))


def test_stop_token_ids_end_with_eos_and_keep_the_stop_token(client: Client) -> None:
    sid = client.open()
    tokens, _ = client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=8, **GREEDY)
    greedy = decoded(tokens)
    stop = greedy[2]
    first = greedy.index(stop)
    fork = client.salience.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=len(PROMPT))).session_id
    tokens, done = client.generate(session_id=fork, offset=len(PROMPT), max_tokens=8, stop_token_ids=[stop], **GREEDY)
    assert decoded(tokens) == greedy[: first + 1]
    assert done.finish_reason == Finish.FINISH_REASON_EOS
    assert client.dump(fork) == PROMPT + greedy[: first + 1]


def test_prefill_only_scores_the_covered_positions(client: Client) -> None:
    sid = client.open()
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    tokens, done = client.generate(
        session_id=sid,
        append_tokens=prompt,
        offset=0,
        max_tokens=0,
        logprobs_ranges=ranges((0, 3)),
        logprob_top_k=3,
        readout_ranges=ranges((2, 5)),
    )
    assert [t.position for t in tokens] == [0, 1, 2, 3, 4]
    assert all(t.is_prefill for t in tokens)
    assert [t.id for t in tokens] == prompt[:5]
    assert done.finish_reason == Finish.FINISH_REASON_LENGTH  # max_tokens=0: the zero budget was reached
    assert (done.prompt_tokens, done.completion_tokens, done.total_tokens) == (8, 0, 8)
    by_position = {t.position: t for t in tokens}
    # Position 0 has nothing before it, so it has no logprob; 1 and 2 do, with 3 alternatives each.
    assert not by_position[0].has_sampled_logprob and not by_position[0].logprobs
    for p in (1, 2):
        token = by_position[p]
        assert token.has_sampled_logprob and token.sampled_logprob <= 0
        assert len(token.logprobs) == 3
        lps = [alt.logprob for alt in token.logprobs]
        assert lps == sorted(lps, reverse=True)
        assert token.sampled_logprob <= lps[0] + 1e-6
    for p in (3, 4):
        assert not by_position[p].has_sampled_logprob and not by_position[p].logprobs
    for p in (2, 3, 4):
        assert len(by_position[p].readout) == 2 * 3  # [n_layers=2][n_concepts=3]
    for p in (0, 1):
        assert not by_position[p].readout
    assert client.dump(sid) == prompt


def test_logprob_top_k_0_gives_only_the_sampled_logprob(client: Client) -> None:
    sid = client.open()
    tokens, _ = client.generate(
        session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=3, logprobs_ranges=ranges((2, 7)), **GREEDY
    )
    covered = [t for t in tokens if 2 <= t.position < 7]
    assert [t.position for t in covered] == [2, 3, 4, 5, 6]
    assert all(t.has_sampled_logprob and not t.logprobs for t in covered)
    # With top-k 1 the sampled token is the argmax, so asking for alternatives must agree.
    sid2 = client.open()
    again, _ = client.generate(
        session_id=sid2,
        append_tokens=PROMPT,
        offset=0,
        max_tokens=3,
        logprobs_ranges=ranges((4, 7)),
        logprob_top_k=2,
        **GREEDY,
    )
    for token in (t for t in again if not t.is_prefill):
        assert token.logprobs[0].id == token.id
        assert token.logprobs[0].logprob == pytest.approx(token.sampled_logprob, abs=1e-5)


async def _core_events(service: Any, action: GenerateAction) -> list[Any]:
    return [event async for event in service.run(action)]


def test_readouts_equal_what_the_core_returns(client: Client, live_server: Any) -> None:
    sid = client.open()
    client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=3, **GREEDY)
    timeline = client.dump(sid)
    tokens, _ = client.generate(
        session_id=sid,
        append_tokens=[40, 41],
        offset=len(timeline),
        max_tokens=2,
        readout_ranges=ranges((1, len(timeline) + 4)),
        logprobs_ranges=ranges((1, len(timeline) + 4)),
        **GREEDY,
    )
    wire = {t.position: t for t in tokens}
    n_layers, n_concepts = 2, 3
    spec = GenerateSpec(
        max_tokens=2,
        top_k=1,
        temperature=1.0,
        readout_ranges=(PositionRange(1, len(timeline) + 4),),
        logprob_ranges=(PositionRange(1, len(timeline) + 4),),
    )
    action = GenerateAction(append_tokens=(*timeline, 40, 41), spec=spec)
    core = [e for e in live_server.call(_core_events(live_server.service, action)) if isinstance(e, TokenEvent)]
    assert [e.position for e in core] == sorted(wire) == list(range(1, len(timeline) + 4))
    for event in core:
        token = wire[event.position]
        assert token.id == event.id
        assert event.readout is not None and event.readout.shape == (n_layers, n_concepts)
        got = np.asarray(token.readout, dtype=np.float32).reshape(n_layers, n_concepts)  # row-major
        np.testing.assert_allclose(got, event.readout, rtol=1e-4, atol=1e-4)
        assert token.sampled_logprob == pytest.approx(event.logprob, abs=1e-4)


def test_empty_generate_is_a_no_op(client: Client) -> None:
    sid = client.open()
    client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=0)
    tokens, done = client.generate(session_id=sid, offset=len(PROMPT))
    assert tokens == []
    assert (done.prompt_tokens, done.completion_tokens) == (len(PROMPT), 0)
    assert client.dump(sid) == PROMPT


def test_offset_drift_is_failed_precondition_with_both_lengths(client: Client) -> None:
    sid = client.open()
    client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=0)
    ahead = rpc_error(client.generate, session_id=sid, append_tokens=[1], offset=7)
    assert ahead.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "7" in ahead.details() and "4" in ahead.details()
    behind = rpc_error(client.generate, session_id=sid, append_tokens=[1], offset=2)
    assert behind.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "2" in behind.details() and "4" in behind.details() and "truncating" in behind.details()
    ahead_truncating = rpc_error(client.generate, session_id=sid, offset=9, truncating=True)
    assert ahead_truncating.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.dump(sid) == PROMPT  # rejected calls change nothing


def test_context_overflow_is_resource_exhausted_and_changes_nothing(client: Client) -> None:
    sid = client.open()
    client.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=0)
    too_long = rpc_error(client.generate, session_id=sid, append_tokens=[5] * 600, offset=4)
    assert too_long.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "512" in too_long.details()
    budget = rpc_error(client.generate, session_id=sid, append_tokens=[5] * 500, offset=4, max_tokens=20)
    assert budget.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tokens" in budget.details()
    assert client.dump(sid) == PROMPT


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"append_tokens": [1, 100000]}, "vocabulary"),
        ({"append_tokens": [1], "max_tokens": 1, "top_p": 1.5}, "top_p"),
        ({"append_tokens": [1], "max_tokens": 1, "temperature": -1.0}, "temperature"),
        ({"append_tokens": [1], "max_tokens": 1, "temperature": float("nan")}, "temperature"),
        ({"append_tokens": [1], "logprobs_ranges": ranges((0, 1)), "logprob_top_k": 21}, "top-k"),
        ({"append_tokens": [1, 2], "readout_ranges": ranges((0, 9))}, "readout range"),
        ({"append_tokens": [1, 2], "logprobs_ranges": ranges((2, 1))}, "ends before"),
        ({"max_tokens": 3}, "empty"),
        (
            {
                "append_tokens": [1, 2, 3],
                "images": [pb.ImageAttachment(bytes=b"x", mime="image/png", pad_range_start=0, pad_range_end=3)],
            },
            "no images",
        ),
    ],
)
def test_invalid_requests_are_invalid_argument(client: Client, fields: dict[str, Any], needle: str) -> None:
    sid = client.open()
    error = rpc_error(client.generate, session_id=sid, offset=0, **fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in error.details()
    assert client.dump(sid) == []


# -- streams that stay open ---------------------------------------------------------------

# A client channel with a 1 KiB receive window and no window growth: a long stream of
# fat events (readouts and 20 alternatives per position) fills it after a few events,
# so the server's handler waits on flow control, mid-generation, until the test acts.
SLOW_READER = {"grpc.http2.lookahead_bytes": 1024, "grpc.http2.bdp_probe": 0}


def long_request(sid: str, offset: int, append: list[int], max_tokens: int = 480) -> pb.GenerateRequest:
    end = offset + len(append) + max_tokens
    return pb.GenerateRequest(
        session_id=sid,
        append_tokens=append,
        offset=offset,
        max_tokens=max_tokens,
        top_k=1,
        readout_ranges=ranges((0, end)),
        logprobs_ranges=ranges((0, end)),
        logprob_top_k=20,
    )


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_cancelled_stream_keeps_the_append_and_drops_decoded_tokens(live_server: Any) -> None:
    slow = connect(live_server.grpc_target, **SLOW_READER)
    try:
        sid = slow.open()
        _, done = slow.generate(session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=3, top_k=1)
        before = slow.dump(sid)
        assert len(before) == 4 + done.completion_tokens

        call = slow.salience.Generate(long_request(sid, len(before), [33, 34, 35]))
        received = [next(call) for _ in range(len(before) + 3 + 2)]  # the prefill plus two decoded tokens
        assert [e.token.is_prefill for e in received][-2:] == [False, False]
        assert live_server.call(live_server.service.session(sid)).busy  # still generating: the cancel lands mid-stream
        call.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == grpc.StatusCode.CANCELLED

        wait_for(lambda: not live_server.call(live_server.service.session(sid)).busy)
        assert slow.dump(sid) == [*before, 33, 34, 35]  # the append stays; the decoded tokens do not
        # The session is usable at once, at exactly the documented length.
        _, done = slow.generate(session_id=sid, offset=len(before) + 3, max_tokens=1, top_k=1)
        assert done.prompt_tokens == len(before) + 3
    finally:
        slow.channel.close()


def test_a_second_generate_on_a_busy_session_is_aborted(live_server: Any, client: Client) -> None:
    slow = connect(live_server.grpc_target, **SLOW_READER)
    try:
        sid = slow.open()
        call = slow.salience.Generate(long_request(sid, 0, PROMPT))
        next(call)
        assert live_server.call(live_server.service.session(sid)).busy
        error = rpc_error(client.generate, session_id=sid, offset=4, max_tokens=1)
        assert error.code() == grpc.StatusCode.ABORTED and "busy" in error.details()
        # Other sessions are not held up by it.
        other = client.open()
        _, done = client.generate(session_id=other, append_tokens=PROMPT, offset=0, max_tokens=2, top_k=1)
        assert done.completion_tokens == 2
        call.cancel()
        wait_for(lambda: not live_server.call(live_server.service.session(sid)).busy)
        assert slow.dump(sid) == PROMPT
    finally:
        slow.channel.close()


def test_concurrent_sessions_stream_independently(live_server: Any) -> None:
    prompts = [[i, i + 1, i + 2, i + 3] for i in (10, 50, 90, 130, 170, 210)]
    client = connect(live_server.grpc_target)

    def run(prompt: list[int]) -> tuple[str, list[int]]:
        sid = client.open()
        tokens, done = client.generate(session_id=sid, append_tokens=prompt, offset=0, max_tokens=24, top_k=1)
        assert done.completion_tokens == len(decoded(tokens))
        return sid, decoded(tokens)

    alone = [run(p)[1] for p in prompts]
    results: dict[int, tuple[str, list[int]]] = {}
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = run(prompts[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        sid, out = results[i]
        assert out == alone[i]  # greedy: the same tokens as when it ran alone
        assert client.dump(sid) == prompt + out
    client.channel.close()


async def test_concurrent_streams_on_one_aio_channel(live_server: Any) -> None:
    """Several streams multiplexed on one HTTP/2 connection, read interleaved."""
    from prismgate.schemas import salience_pb2_grpc

    async with grpc.aio.insecure_channel(live_server.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        sids = [(await stub.OpenSession(pb.OpenSessionRequest(model="tiny-llama"))).session_id for _ in range(4)]

        async def one(sid: str, k: int) -> list[pb.GenerateEvent]:
            request = pb.GenerateRequest(session_id=sid, append_tokens=[k, k, k], offset=0, max_tokens=10 + k, top_k=1)
            return [event async for event in stub.Generate(request)]

        results = await asyncio.gather(*(one(sid, k) for k, sid in enumerate(sids)))
        for k, (sid, events) in enumerate(zip(sids, results, strict=True)):
            assert events[-1].done.completion_tokens == 10 + k
            dump = await stub.DumpSession(pb.DumpSessionRequest(session_id=sid))
            assert list(dump.tokens) == [k, k, k] + [e.token.id for e in events[:-1]]
