"""The cppack layout without a server: frames the real client wrote, read by the codec; the codec's, read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from prismgate.codecs.actionengine import translate, wire
from prismgate.core.errors import Code, GatewayError
from prismgate.schemas import evergreen_pb2 as pb
from tests.actionengine import frames

# action-engine 0.4.0 calling GENERATE 'act1' and streaming its prompt: put("sys"), put("q"), finalize()
CAPTURED = [bytes.fromhex(line) for line in Path(__file__).with_name("captured_generate.hex").read_text().split()]
LIMITS = wire.Limits()


def test_frames_the_library_wrote_decode_to_what_it_sent() -> None:
    action, form = wire.decode(CAPTURED[0], LIMITS, "frame 1")
    assert form is wire.Form.RELEASE and not action.fragments
    assert action.actions == (
        wire.ActionMessage(
            "act1", "GENERATE", (wire.Port("prompt", "act1#prompt"),), (wire.Port("response", "act1#response"),)
        ),
    )
    chunks = [wire.decode(frame, LIMITS, "frame")[0].fragments[0] for frame in CAPTURED[1:4]]
    assert [(f.id, f.seq, f.continued) for f in chunks] == [("act1#prompt", s, s < 2) for s in range(3)]
    assert [f.data.data for f in chunks] == [b"sys", b"q", b""]  # type: ignore[union-attr]
    assert [f.data.is_null for f in chunks] == [False, False, True]  # type: ignore[union-attr]
    closing, _ = wire.decode(CAPTURED[4], LIMITS, "frame 5")
    assert closing.is_half_close


def test_the_tests_frames_are_the_bytes_the_library_writes() -> None:
    assert frames.generate("act1", config=False, release=True) == CAPTURED[0]
    assert frames.half_close(release=True) == CAPTURED[4]


def test_the_head_layout_has_no_headers_and_is_read_too() -> None:
    message, form = wire.decode(frames.generate("a", config=True, release=False), LIMITS, "frame 1")
    assert form is wire.Form.HEAD
    assert [p.name for p in message.actions[0].inputs] == ["prompt", "config"]


def test_a_node_becomes_a_parent_of_one_leaf_per_chunk_and_the_config_input_is_held_back() -> None:
    calls = translate.inbound(frames.generate("a", config=True, release=True), LIMITS, "frame 1").calls
    assert calls[0].config == "a#config" and [p.name for p in calls[0].action.inputs] == ["prompt"]
    moved = [translate.inbound(frame, LIMITS, "f").fragments.node_fragments for frame in CAPTURED[1:4]]
    assert [list(m[0].child_ids) for m in moved] == [["act1#prompt[0]"], ["act1#prompt[1]"], []]
    assert moved[0][1].chunk_fragment.data == b"sys" and moved[0][1].chunk_fragment.metadata.mimetype == "text/plain"
    assert not moved[2][0].continued  # the null chunk ends the node


def test_the_writer_streams_chunks_with_their_mimetype_then_the_status() -> None:
    writer = translate.Writer(wire.Form.HEAD)
    call = translate.inbound(frames.generate("a", config=False, release=False), LIMITS, "f").calls[0]
    writer.track(call)
    first = pb.NodeFragment(id="a#response", seq=0, continued=True)
    first.chunk_fragment.data = b"Hel"
    first.chunk_fragment.metadata.mimetype, first.chunk_fragment.metadata.role = "text/plain", "assistant"
    second = pb.NodeFragment(id="a#response", seq=1, continued=True)
    second.chunk_fragment.data = b"lo"
    end = pb.NodeFragment(id="a#response", seq=2)
    frame = writer.encode(pb.SessionMessage(node_fragments=[first, second, end]))
    assert frame is not None
    out, actions = frames.read(frame, release=False)
    assert actions == []
    assert [(f["id"], f["seq"], f["data"], f["mimetype"]) for f in out] == [
        ("a#response", 0, b"Hel", "text/plain"),
        ("a#response", 1, b"lo", "text/plain"),
        ("a#response", 2, b"", wire.NULL_MIMETYPE),
        ("a#__status__", 0, b"\x00", "__status__"),
    ]
    assert out[1]["attributes"] == {"role": "assistant"}


def test_a_failure_reaches_every_open_output_and_the_status() -> None:
    writer = translate.Writer(wire.Form.RELEASE)
    writer.track(translate.inbound(frames.generate("a", config=False, release=True), LIMITS, "f").calls[0])
    frame = writer.failure(GatewayError(Code.RESOURCE_EXHAUSTED, "over"))
    assert frame is not None
    out, _ = frames.read(frame, release=True)
    assert [(f["id"], f["data"], f["mimetype"]) for f in out] == [
        ("a#response", b"\x08over", "__status__"),
        ("a#__status__", b"\x08over", "__status__"),
    ]
    assert writer.failure(GatewayError(Code.INTERNAL, "again")) is None  # each action is told once


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\xc4", "truncated in its length field"),
        (frames.wrap(b"\x90\x90\x01"), "truncated before headers key 0"),
        (frames.wrap(b"\x90\x90\x00\x00"), "1 bytes after the last field"),
        (frames.wrap(b"\x81\xa1a\x01"), "must be a msgpack array, got 0x81"),
        (frames.wrap(b"\x91" + frames.struct(b"\x02")), "variant is 2, outside 0..1"),
        (
            frames.wrap(b"\x90\x91" + frames.struct(frames.pack("a", "GENERATE"), b"\x91\x90\x90")),
            "port 0 must be a msgpack bin",
        ),
    ],
)
def test_malformed_frames_are_refused_precisely(frame: bytes, message: str) -> None:
    with pytest.raises(GatewayError) as error:
        wire.decode(frame, LIMITS, "frame 1")
    assert message in error.value.message


def test_every_count_and_size_is_checked_before_what_it_announces() -> None:
    small = wire.Limits(max_chunk_bytes=8, max_fragments=2, max_string_bytes=16)
    with pytest.raises(GatewayError, match="the limit is") as error:
        wire.decode(frames.text("n", "x" * 100, release=True), small, "frame 1")
    assert error.value.code is Code.RESOURCE_EXHAUSTED
    with pytest.raises(GatewayError, match="3 node fragments in one message; the limit is 2"):
        wire.decode(frames.wrap(b"\x93" + b"\xc4\x00" * 3 + b"\x90"), small, "frame 1")
    with pytest.raises(GatewayError, match="larger than this server takes"):
        wire.decode(frames.text("n" * 40, "x", release=True), small, "frame 1")


def test_integers_are_written_in_the_signed_forms_cppack_reads() -> None:
    assert [wire.integer(v) for v in (0, 127, 128, -1, 40000, 2**31)] == [
        b"\x00",
        b"\x7f",
        b"\xd1\x00\x80",
        b"\xff",
        b"\xd2\x00\x00\x9c\x40",
        b"\xd3" + (2**31).to_bytes(8, "big"),
    ]


def ref_fragment(node_id: str, target: str, offset: int = 0) -> bytes:
    """A fragment of variant 1: a node ref to ``target`` from ``offset`` on (no length)."""
    return frames.struct(
        frames.pack(1), frames.struct(frames.pack(target, offset, None)), frames.pack(True, node_id, 1)
    )


def test_a_node_ref_stands_for_the_whole_node_it_names() -> None:
    whole = frames.message([ref_fragment("n", "earlier#response")], release=True)
    moved = translate.inbound(whole, LIMITS, "f").fragments.node_fragments
    assert [(f.id, f.seq, f.continued, list(f.child_ids)) for f in moved] == [("n", 1, True, ["earlier#response"])]
    part = frames.message([ref_fragment("n", "earlier#response", offset=4)], release=True)
    with pytest.raises(GatewayError, match="part of a node is not supported"):
        translate.inbound(part, LIMITS, "f")


def test_evergreen_protobuf_frames_never_look_like_actionengine_frames() -> None:
    """A SessionMessage starts with the tag of field 1 or 2; an ActionEngine frame with a bin header."""
    message = pb.SessionMessage(node_fragments=[pb.NodeFragment(id="n" * 300)])
    message.actions.add(name="GENERATE").inputs.add(name="prompt", id="p")
    assert not wire.looks_like_wire(message.SerializeToString())
    assert not wire.looks_like_wire(pb.SessionMessage(actions=message.actions).SerializeToString())
    assert all(wire.looks_like_wire(frame) for frame in CAPTURED)
