"""ActionEngine frames written and read with msgpack alone, as cppack lays them out (independent of the codec).

A struct is a msgpack ``bin`` of its fields one after another; ``release`` adds the trailing
header count of the 0.4.0 release on PyPI (zero headers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack


def pack(*values: Any) -> bytes:
    return b"".join(msgpack.packb(v, use_bin_type=True) for v in values)


def struct(*values: Any) -> bytes:
    """A struct: its fields' bytes (already packed) as one msgpack bin."""
    return msgpack.packb(b"".join(values), use_bin_type=True)


def array(items: Sequence[bytes]) -> bytes:
    return msgpack.Packer().pack_array_header(len(items)) + b"".join(items)


def bin_header(length: int) -> bytes:
    return b"\xc6" + length.to_bytes(4, "big")


def wrap(body: bytes) -> bytes:
    """A frame around an already packed WireMessage body."""
    return msgpack.packb(body, use_bin_type=True)


def message(fragments: Sequence[bytes] = (), actions: Sequence[bytes] = (), *, release: bool) -> bytes:
    return wrap(array(fragments) + array(actions) + (b"\x00" if release else b""))


def generate(action_id: str, *, config: bool, release: bool, outputs: Sequence[str] = ("response",)) -> bytes:
    inputs = ["prompt"] + (["config"] if config else [])
    ports = [array([struct(pack(n, f"{action_id}#{n}")) for n in names]) for names in (inputs, outputs)]
    action = struct(pack(action_id, "GENERATE"), *ports, b"\x00" if release else b"")
    return message(actions=[action], release=release)


def text(node_id: str, value: str, *, release: bool) -> bytes:
    """A node of one text/plain chunk, final (what ``put_and_finalize("...")`` sends)."""
    metadata = struct(pack("text/plain", None, 0))
    chunk = struct(pack(value.encode(), ""), metadata)
    fragment = struct(pack(0), chunk, pack(False, node_id, 0))
    return message([fragment], release=release)


def half_close(release: bool) -> bytes:
    return message(release=release)


def read(frame: bytes, *, release: bool) -> tuple[list[dict[str, Any]], list[bytes]]:
    """A server frame: its fragments (chunks only) as dicts, and its raw actions; the layout must be ``release``'s."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(msgpack.unpackb(frame))
    fragments, actions = unpacker.unpack(), unpacker.unpack()
    rest = list(unpacker)
    assert rest == ([0] if release else []), f"trailing fields {rest} in a {'0.4.0' if release else 'head'} frame"
    out = []
    for raw in fragments:
        variant, chunk, continued, node_id, seq = _values(raw)
        assert variant == 0
        data, _ref, metadata = _values(chunk)
        mimetype, _timestamp, count, *attributes = _values(metadata)
        assert count * 2 == len(attributes)
        out.append(
            {
                "id": node_id,
                "seq": seq,
                "continued": continued,
                "data": data,
                "mimetype": mimetype,
                "attributes": dict(zip(attributes[::2], attributes[1::2], strict=True)),
            }
        )
    return out, actions


def _values(raw: bytes) -> list[Any]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(raw)
    return list(unpacker)
