"""Evergreen over a real WebSocket (a live gateway, the `websockets` client library)."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from prismgate.schemas import evergreen_pb2 as pb
from tests.evergreen.wire import (
    CONFIG,
    EOT,
    Collector,
    b64,
    closed_with,
    eot_leaf,
    generate,
    msg,
    parent,
    text_leaf,
    uid,
)


def connect(server, path: str = "/evergreen"):  # type: ignore[no-untyped-def]
    return websockets.connect(server.ws_url + path, max_size=None)


def assert_streamed(out) -> None:  # type: ignore[no-untyped-def]
    """Fragments of one output: seq 0..n in order, continued on all but the last, metadata on seq 0."""
    seqs = sorted(out.fragments)
    assert seqs == list(range(len(seqs)))
    assert out.arrival == seqs, "fragments must arrive in seq order"
    assert all(out.fragments[s].get("continued") for s in seqs[:-1])
    assert not out.fragments[seqs[-1]].get("continued", False)
    assert out.metadata["mimetype"] == "text/plain"


async def test_spec_examples_follow_up_reuses_the_conversation_prefix(live_server) -> None:
    """The spec's first example (plural field names; the video is a two-part text leaf) and its follow-up."""
    async with connect(live_server) as ws:
        c = Collector(ws)
        await ws.send(
            msg(
                actions=[
                    generate("prompt_1", "response_1", config={"maxTokens": 6}, extra_outputs={"usage": "usage_1"})
                ],
                fragments=[
                    parent("prompt_1", "question_1", "video_1"),
                    text_leaf("question_1", "Write a summary of this video: "),
                    {
                        "id": "video_1",
                        "seq": 0,
                        "continued": True,
                        "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "data": b64("part one, ")},
                    },
                    {
                        "id": "video_1",
                        "seq": 1,
                        "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "data": b64("part two.")},
                    },
                ],
            )
        )
        first = await c.until_complete("response_1", "usage_1")
        assert_streamed(first["response_1"])
        assert len(first["response_1"].fragments) >= 2, "the answer streams in several fragments"
        usage_1 = first["usage_1"].lines[0]
        assert usage_1["completionTokens"] == 6 and usage_1["reusedTokens"] == 0

        await ws.send(
            msg(
                actions=[
                    generate("prompt_2", "response_2", config={"maxTokens": 4}, extra_outputs={"usage": "usage_2"})
                ],
                fragments=[
                    parent("prompt_2", "prompt_1", "response_1", "question_2"),
                    text_leaf("question_2", "Who's winning?"),
                ],
            )
        )
        second = await c.until_complete("response_2", "usage_2")
        assert_streamed(second["response_2"])
        usage_2 = second["usage_2"].lines[0]
        turn_1 = usage_1["promptTokens"] + usage_1["completionTokens"]
        # the earlier answer is reused token for token: only the new question is prefilled
        assert usage_2["reusedTokens"] == turn_1
        assert usage_2["appendedTokens"] == usage_2["promptTokens"] - turn_1
        # the engine has the KV of all of it but the last sampled token (never fed through the model)
        assert usage_2["cachedTokens"] >= turn_1 - 1
        assert usage_2["prefilledTokens"] == usage_2["promptTokens"] - usage_2["cachedTokens"]


async def test_customized_generate_example_with_binary_config_and_end_of_turn(live_server) -> None:
    async with connect(live_server) as ws:
        action = generate("prompt_1", "response_1", input_name="text", output_name="text")
        action["configs"] = [{"@type": CONFIG, "maxTokens": 3, "temperature": 0}]
        await ws.send(
            msg(
                actions=[action],
                fragments=[
                    parent("prompt_1", "prompt_1_text", "prompt_1_eot"),
                    text_leaf("prompt_1_text", "Write a heroic novel about a half-eaten jam doughnut."),
                    eot_leaf("prompt_1_eot"),
                ],
            )
        )
        out = (await Collector(ws).until_complete("response_1"))["response_1"]
        assert_streamed(out)
        assert out.metadata["role"] == "assistant"


async def test_streamed_chains_example(live_server) -> None:
    async with connect(live_server) as ws:
        c = Collector(ws)
        await ws.send(
            msg(
                actions=[
                    generate("prompt_1", "response_1", input_name="text", output_name="text", config={"maxTokens": 3})
                ]
            )
        )
        await ws.send(msg(fragments=[parent("prompt_1", "prompt_1_text", continued=True)]))
        await ws.send(
            msg(fragments=[text_leaf("prompt_1_text", "Write a heroic novel about a half-eaten jam doughnut.")])
        )
        with pytest.raises(TimeoutError):  # the barrier holds: prompt_1 is still continued
            await c.until_complete("response_1", within=0.5)
        await ws.send(msg(fragments=[parent("prompt_1", "prompt_1_eot", seq=1), eot_leaf("prompt_1_eot")]))
        assert_streamed((await c.until_complete("response_1"))["response_1"])


async def test_transcript_in_the_style_of_real_clients(live_server) -> None:
    """Action first in its own message, UUID ids, one fragment per chunk with metadata repeated, empty terminator."""
    prompt, text_node, response, usage = uid(), uid(), uid(), uid()
    async with connect(live_server) as ws:
        c = Collector(ws)
        await ws.send(
            msg(actions=[generate(prompt, response, config={"maxTokens": 5}, extra_outputs={"usage": usage})])
        )
        await ws.send(msg(fragments=[parent(prompt, text_node)]))
        for seq, piece in enumerate(["Tell me ", "a short ", "story."]):
            await ws.send(msg(fragments=[text_leaf(text_node, piece, role="user", seq=seq, continued=True)]))
        await ws.send(msg(fragments=[{"id": text_node, "seq": 3}]))  # the empty terminator
        outs = await c.until_complete(response, usage)
        assert_streamed(outs[response])
        assert outs[usage].lines[0]["completionTokens"] == 5
        # the prompt was rendered from all three chunks: same length as sending the text in one piece
        prompt_b, node_b, response_b, usage_b = uid(), uid(), uid(), uid()
    async with connect(live_server) as ws:
        await ws.send(
            msg(
                actions=[generate(prompt_b, response_b, config={"maxTokens": 5}, extra_outputs={"usage": usage_b})],
                fragments=[parent(prompt_b, node_b), text_leaf(node_b, "Tell me a short story.", role="user")],
            )
        )
        again = await Collector(ws).until_complete(response_b, usage_b)
        assert again[usage_b].lines[0]["promptTokens"] == outs[usage].lines[0]["promptTokens"]
        assert again[response_b].text == outs[response].text  # greedy: same prompt, same answer


async def test_binary_frames_get_binary_replies(live_server) -> None:
    message = pb.SessionMessage()
    action = message.actions.add(name="GENERATE")
    action.inputs.add(name="prompt", id="p")
    action.outputs.add(name="response", id="r")
    fragment = message.node_fragments.add(id="p")
    fragment.chunk_fragment.metadata.mimetype = "text/plain"
    fragment.chunk_fragment.data = "héllo".encode()
    async with connect(live_server) as ws:
        await ws.send(message.SerializeToString())
        c = Collector(ws)
        out = (await c.until_complete("r"))["r"]
        assert all(isinstance(f, bytes) for f in c.frames)
        assert out.complete


async def test_readouts_and_logprobs_stream_alongside(live_server) -> None:
    async with connect(live_server) as ws:
        await ws.send(
            msg(
                actions=[
                    generate(
                        "p",
                        "r",
                        config={"maxTokens": 4, "topLogprobs": 3},
                        extra_outputs={"readouts": "ro", "logprobs": "lp", "usage": "u"},
                    )
                ],
                fragments=[text_leaf("p", "Hi")],
            )
        )
        outs = await Collector(ws).until_complete("r", "ro", "lp", "u")
        manifest = live_server.service.info().readouts
        header, *rows = outs["ro"].lines
        assert outs["ro"].metadata["mimetype"] == "application/x-ndjson; schema=prismgate.readouts.v1"
        assert header["concepts"] == list(manifest.concepts) and header["layers"] == list(manifest.layers)
        assert [r["index"] for r in rows] == [0, 1, 2, 3]
        assert all(
            len(r["values"]) == len(manifest.layers) and len(r["values"][0]) == len(manifest.concepts) for r in rows
        )
        logprobs = outs["lp"].lines
        assert [r["index"] for r in logprobs] == [0, 1, 2, 3]
        assert all(r["logprob"] <= 0 and len(r["top"]) == 3 for r in logprobs)
        assert [r["tokenId"] for r in rows] == [r["tokenId"] for r in logprobs]
        prompt_len = outs["u"].lines[0]["promptTokens"]
        assert [r["position"] for r in logprobs] == [prompt_len + i for i in range(4)]
        assert "".join(r["text"] for r in logprobs) == outs["r"].text


async def test_data_uri_refs_are_read(live_server) -> None:
    async with connect(live_server) as ws:
        await ws.send(
            msg(
                actions=[generate("p", "r", config={"maxTokens": 2}, extra_outputs={"usage": "u"})],
                fragments=[
                    {
                        "id": "p",
                        "chunkFragment": {
                            "metadata": {"mimetype": "text/plain"},
                            "ref": "data:text/plain;base64," + b64("Hi"),
                        },
                    }
                ],
            )
        )
        out = await Collector(ws).until_complete("r", "u")
        assert out["u"].lines[0]["completionTokens"] == 2


# -- aborts ------------------------------------------------------------------------------


async def aborted(server, *messages: str | bytes) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    async with connect(server) as ws:
        for m in messages:
            await ws.send(m)
        return await closed_with(ws)


@pytest.mark.parametrize(
    ("messages", "code", "words"),
    [
        (
            [msg(fragments=[text_leaf("a", "x", continued=True), {"id": "a", "seq": 1}, text_leaf("a", "y", seq=2)])],
            4400,
            ["node 'a' seq 2", "past"],
        ),
        (
            [
                msg(
                    fragments=[
                        text_leaf("a", "x", continued=True, role="user"),
                        text_leaf("a", "y", seq=1, role="model"),
                    ]
                )
            ],
            4400,
            ["node 'a' seq 1", "metadata differs"],
        ),
        ([msg(fragments=[text_leaf("a", "x", continued=True), parent("a", "b", seq=1)])], 4400, ["'a' is a leaf"]),
        ([msg(fragments=[parent("a", "b"), parent("b", "a")])], 4400, ["'b'", "cycle"]),
        ([msg(actions=[{"name": "TRANSLATE"}])], 4400, ["action #1", "unknown action 'TRANSLATE'"]),
        ([msg(fragments=[text_leaf("r", "x")]), msg(actions=[generate("p", "r")])], 4400, ["output id 'r' is not new"]),
        ([msg(actions=[generate("p", "r", config={"maxTokens": 2, "temprature": 1})])], 4400, ["temprature"]),
        ([msg(actions=[generate("p", "r", output_name="answer")])], 4400, ["unknown output 'answer'"]),
        (["{not json"], 4400, ["frame 1", "JSON"]),
        (
            [
                msg(
                    actions=[generate("p", "r")],
                    fragments=[
                        {
                            "id": "p",
                            "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "ref": "file:///etc/passwd"},
                        }
                    ],
                )
            ],
            4400,
            ["action #1", "file: refs"],
        ),
        (
            [
                msg(
                    actions=[generate("p", "r")],
                    fragments=[
                        {
                            "id": "p",
                            "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "ref": "https://example.com/x"},
                        }
                    ],
                )
            ],
            4400,
            ["http(s) refs"],
        ),
        (
            [
                msg(
                    actions=[generate("p", "r")],
                    fragments=[
                        {"id": "p", "chunkFragment": {"metadata": {"mimetype": "image/png"}, "data": b64(b"\x89PNG")}}
                    ],
                )
            ],
            4400,
            ["takes no images"],
        ),
        (
            [
                msg(
                    actions=[generate("p", "r")],
                    fragments=[
                        {"id": "p", "chunkFragment": {"metadata": {"mimetype": "video/mp4"}, "data": b64(b"x")}}
                    ],
                )
            ],
            4400,
            ["'p'", "video/mp4"],
        ),
        ([msg(actions=[{"name": "CANCEL", "inputs": [{"name": "output", "id": "nobody"}]}])], 4404, ["'nobody'"]),
    ],
    ids=[
        "seq-past-final",
        "metadata-mismatch",
        "leaf-then-children",
        "cycle",
        "unknown-action",
        "output-reused",
        "unknown-config-field",
        "unknown-output",
        "bad-json",
        "file-ref-off",
        "http-ref-off",
        "image-text-model",
        "unsupported-mime",
        "cancel-unknown",
    ],
)
async def test_abort_convention(live_server, messages, code, words) -> None:
    got_code, reason = await aborted(live_server, *messages)
    assert got_code == code, reason
    assert len(reason.encode()) <= 123
    for word in words:
        assert word in reason, reason


async def test_an_abort_leaves_other_sessions_untouched(live_server) -> None:
    async with connect(live_server) as good:
        await good.send(msg(actions=[generate("p", "r", config={"maxTokens": 40, "ignoreEos": True})]))
        code, _ = await aborted(live_server, msg(fragments=[parent("x", "x")]))
        assert code == 4400
        await good.send(msg(fragments=[text_leaf("p", "still here?")]))
        out = (await Collector(good).until_complete("r"))["r"]
        assert out.complete and len(out.data) > 0


async def test_limits_come_from_settings(server_factory) -> None:
    with server_factory(evergreen_max_nodes=4, evergreen_max_depth=3, evergreen_max_bytes=4096) as server:
        code, reason = await aborted(server, msg(fragments=[parent("a", "b", "c", "d", "e")]))
        assert code == 4429 and "more than 4 nodes" in reason
        code, reason = await aborted(server, msg(fragments=[parent("a", "b"), parent("b", "c"), parent("c", "d")]))
        assert code == 4400 and "depth 4" in reason
        code, reason = await aborted(server, msg(fragments=[text_leaf("a", "x" * 5000)]))
        assert code == 4429 and "4096 bytes" in reason


async def test_auth_token_in_header_or_query(server_factory) -> None:
    with server_factory(auth_token="s3cret") as server:
        code, reason = await aborted(server)
        assert code == 4401 and "UNAUTHENTICATED" in reason
        for ws_args in ({"additional_headers": {"Authorization": "Bearer s3cret"}}, {}):
            path = "/evergreen" if ws_args else "/evergreen?access_token=s3cret"
            async with websockets.connect(server.ws_url + path, **ws_args) as ws:
                await ws.send(
                    msg(actions=[generate("p", "r", config={"maxTokens": 1})], fragments=[text_leaf("p", "a")])
                )
                assert (await Collector(ws).until_complete("r"))["r"].complete


async def test_file_refs_under_the_configured_root(server_factory, tmp_path) -> None:
    (tmp_path / "q.txt").write_text("Hello from a file")
    with server_factory(evergreen_file_root=str(tmp_path)) as server:
        async with connect(server) as ws:
            await ws.send(
                msg(
                    actions=[generate("p", "r", config={"maxTokens": 1}, extra_outputs={"usage": "u"})],
                    fragments=[
                        {
                            "id": "p",
                            "chunkFragment": {
                                "metadata": {"mimetype": "text/plain"},
                                "ref": (tmp_path / "q.txt").as_uri(),
                            },
                        }
                    ],
                )
            )
            assert (await Collector(ws).until_complete("u"))["u"].lines[0]["promptTokens"] > 17
        code, reason = await aborted(
            server,
            msg(
                actions=[generate("p", "r")],
                fragments=[
                    {"id": "p", "chunkFragment": {"metadata": {"mimetype": "text/plain"}, "ref": "file:///etc/hosts"}}
                ],
            ),
        )
        assert code == 4400 and "outside the allowed root" in reason


# -- extensions ------------------------------------------------------------------------


async def test_cancel_stops_an_action_and_the_session_goes_on(live_server) -> None:
    async with connect(live_server) as ws:
        c = Collector(ws)
        await ws.send(
            msg(
                actions=[
                    generate("p", "r", config={"maxTokens": 470, "ignoreEos": True}, extra_outputs={"usage": "u"})
                ],
                fragments=[text_leaf("p", "Go on forever")],
            )
        )
        async with asyncio.timeout(60):
            while "r" not in c.outputs:
                c.add(json.loads(await ws.recv()))
        await ws.send(msg(actions=[{"name": "CANCEL", "inputs": [{"name": "output", "id": "r"}]}]))
        outs = await c.until_complete("r", "u")
        usage = outs["u"].lines[0]
        assert usage["finishReason"] == "cancelled"
        assert usage["completionTokens"] < 470 and len(outs["r"].fragments) < 470
        # cancelling again (a race with the end) is not an error, and the session still works
        await ws.send(
            msg(
                actions=[
                    {"name": "CANCEL", "inputs": [{"name": "output", "id": "r"}]},
                    generate("p2", "r2", config={"maxTokens": 2}, extra_outputs={"usage": "u2"}),
                ],
                fragments=[parent("p2", "p", "q2"), text_leaf("q2", "again")],
            )
        )
        again = await c.until_complete("r2", "u2")
        assert again["u2"].lines[0]["finishReason"] == "length"
        assert again["u2"].lines[0]["completionTokens"] == 2


async def test_drop_forgets_nodes(live_server) -> None:
    async with connect(live_server) as ws:
        c = Collector(ws)
        await ws.send(
            msg(
                actions=[generate("p", "r", config={"maxTokens": 2})],
                fragments=[parent("p", "q"), text_leaf("q", "first")],
            )
        )
        await c.until_complete("r")
        # DROP waits for earlier actions to read their inputs, so it may follow a GENERATE at once
        await ws.send(
            msg(
                actions=[
                    generate("p2", "r2", config={"maxTokens": 2}),
                    {"name": "DROP", "inputs": [{"name": "node", "id": "p"}, {"name": "node", "id": "r"}]},
                ],
                fragments=[parent("p2", "p", "r", "q2"), text_leaf("q2", "second")],
            )
        )
        assert (await c.until_complete("r2"))["r2"].complete
        await ws.send(msg(actions=[generate("p3", "r3")], fragments=[parent("p3", "q")]))
        code, reason = await closed_with(ws)
        assert code == 4400 and "'q'" in reason and "dropped" in reason


async def test_follow_up_may_be_sent_before_the_first_answer_finishes(live_server) -> None:
    """A node may name an output that does not exist yet: the barrier waits for it."""
    async with connect(live_server) as ws:
        await ws.send(
            msg(
                actions=[
                    generate("p1", "r1", config={"maxTokens": 5}),
                    generate("p2", "r2", config={"maxTokens": 3}, extra_outputs={"usage": "u2"}),
                ],
                fragments=[
                    parent("p1", "q1"),
                    text_leaf("q1", "one"),
                    parent("p2", "p1", "r1", "q2"),
                    text_leaf("q2", "two"),
                ],
            )
        )
        outs = await Collector(ws).until_complete("r1", "r2", "u2")
        assert outs["u2"].lines[0]["reusedTokens"] > 5


async def test_end_of_turn_splits_messages_of_one_role(live_server) -> None:
    """Two user chunks joined vs separated by EndOfTurn: the second renders one more chat turn."""
    lengths = []
    for with_eot in (False, True):
        async with connect(live_server) as ws:
            kids = ["a", "eot", "b"] if with_eot else ["a", "b"]
            await ws.send(
                msg(
                    actions=[generate("p", "r", config={"maxTokens": 1}, extra_outputs={"usage": "u"})],
                    fragments=[
                        parent("p", *kids),
                        text_leaf("a", "x"),
                        text_leaf("b", "y"),
                        {"id": "eot", "chunkFragment": {"metadata": {"mimetype": EOT}}},
                    ],
                )
            )
            lengths.append((await Collector(ws).until_complete("u"))["u"].lines[0]["promptTokens"])
    assert lengths[1] > lengths[0]
