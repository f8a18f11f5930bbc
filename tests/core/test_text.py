"""Streaming detokenization: UTF-8 safety and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from prismgate.core.text import TextStream


def byte_decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, stops: tuple[str, ...] = ()) -> tuple[list[str], str, str | None]:
    ts = TextStream(byte_decode, stops)
    pieces = [ts.push(b) for b in text.encode()]
    return pieces, ts.flush(), ts.stopped_on


def test_multibyte_characters_are_never_split() -> None:
    pieces, tail, _ = stream("né 🙂 ok")
    assert "".join(pieces) + tail == "né 🙂 ok"
    assert all("\ufffd" not in p for p in pieces)
    assert "🙂" in pieces  # released whole, on its last byte


def test_stop_string_cuts_the_text_and_is_reported() -> None:
    pieces, tail, stopped = stream("hello END world", ("END",))
    assert "".join(pieces) + tail == "hello "
    assert stopped == "END"


def test_partial_stop_prefix_is_held_then_released() -> None:
    pieces, tail, stopped = stream("a EN b", ("END",))
    assert stopped is None
    assert "".join(pieces) + tail == "a EN b"
    assert "".join(pieces[:4]) == "a "  # "EN" was held back while it could still become "END"


def test_unfinished_stop_prefix_comes_out_at_flush() -> None:
    pieces, tail, stopped = stream("abc EN", ("END",))
    assert stopped is None and "".join(pieces) == "abc " and tail == "EN"


def test_include_stop_keeps_the_stop_string_and_min_tokens_defers_it() -> None:
    ts = TextStream(byte_decode, ("ab",), include_stop=True)
    assert "".join(ts.push(b) for b in b"xxabyy") == "xxab" and ts.stopped_on == "ab"
    # the first "ab" is inside the first 3 tokens: only the second one stops the text
    ts = TextStream(byte_decode, ("ab",), min_tokens=3)
    assert "".join(ts.push(b) for b in b"abcabd") == "abc" and ts.stopped_on == "ab"
