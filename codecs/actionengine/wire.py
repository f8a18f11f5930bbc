"""ActionEngine's wire: one ``WireMessage`` per binary WebSocket frame, in cppack's positional msgpack layout.

cppack (the C++ serializer of google-deepmind/actionengine) writes a struct as a msgpack ``bin``
holding its fields' values one after another; a list is a msgpack array of such ``bin``s. Both
forms of the trailing headers are read (the PyPI release's count and pairs, the repository
head's nothing), and :class:`Form` records which one a client used so the answer is written the
same way. Reading is bounded by :class:`Limits` before every value and count. The layout, the
limits and cppack's own choices that the writer follows: docs/actionengine.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import msgpack

from prismgate.core.errors import exhausted, invalid

T = TypeVar("T")

NULL_MIMETYPE = "application/octet-stream"
STATUS_MIMETYPE = "__status__"


class Form(Enum):
    """Which layout a client writes: the repository's head (no headers) or the 0.4.0 release (trailing headers)."""

    HEAD = "head"
    RELEASE = "0.4"


@dataclass(frozen=True, slots=True)
class Limits:
    """What one frame may hold; each is checked before what it counts is read."""

    max_frame_bytes: int = 64 * 1024 * 1024
    max_chunk_bytes: int = 16 * 1024 * 1024
    max_fragments: int = 10_000
    max_actions: int = 1024
    max_ports: int = 64
    max_string_bytes: int = 4096  # ids, names, mimetypes, refs, attribute and header keys and values
    max_attributes: int = 64
    max_headers: int = 64


@dataclass(frozen=True, slots=True)
class ChunkMetadata:
    mimetype: str = ""
    timestamp_us: int | None = None
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Chunk:
    data: bytes = b""
    ref: str = ""
    metadata: ChunkMetadata | None = None

    @property
    def is_null(self) -> bool:
        """The end-of-stream marker: no data, no ref, ``application/octet-stream``."""
        return not self.data and not self.ref and self.metadata is not None and self.metadata.mimetype == NULL_MIMETYPE


@dataclass(frozen=True, slots=True)
class NodeRef:
    id: str
    offset: int = 0
    length: int | None = None


@dataclass(frozen=True, slots=True)
class NodeFragment:
    id: str
    data: Chunk | NodeRef
    seq: int | None = None
    continued: bool = False


@dataclass(frozen=True, slots=True)
class Port:
    name: str
    id: str


@dataclass(frozen=True, slots=True)
class ActionMessage:
    id: str
    name: str
    inputs: tuple[Port, ...] = ()
    outputs: tuple[Port, ...] = ()
    headers: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WireMessage:
    fragments: tuple[NodeFragment, ...] = ()
    actions: tuple[ActionMessage, ...] = ()
    headers: dict[str, bytes] = field(default_factory=dict)

    @property
    def is_half_close(self) -> bool:
        """An empty message: the sender will send nothing more."""
        return not self.fragments and not self.actions


# -- reading ---------------------------------------------------------------------

_BIN = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # bin8/16/32: bytes of the length that follows
_ARRAYS = frozenset({0xDC, 0xDD}) | frozenset(range(0x90, 0xA0))
_MAPS = frozenset({0xDE, 0xDF}) | frozenset(range(0x80, 0x90))
_NIL = 0xC0


def looks_like_wire(frame: bytes) -> bool:
    """Whether a binary frame is ActionEngine's (a msgpack ``bin``) rather than an Evergreen protobuf.

    A ``SessionMessage`` starts with the tag of one of its few fields (a byte under 0x80);
    a ``bin`` header is 0xc4-0xc6, which protobuf would read as a tag of field 24 or more.
    """
    return frame[:1] in (b"\xc4", b"\xc5", b"\xc6")


def bin_extent(raw: bytes | memoryview, where: str) -> tuple[int, int]:
    """(start, length) of the msgpack ``bin`` that ``raw`` must be, from its header alone."""
    if not raw:
        raise invalid(f"{where}: empty; an ActionEngine frame is a msgpack bin")
    width = _BIN.get(raw[0])
    if width is None:
        raise invalid(f"{where}: starts with 0x{raw[0]:02x}; an ActionEngine frame is a msgpack bin")
    if len(raw) < 1 + width:
        raise invalid(f"{where}: truncated in its length field")
    length = int.from_bytes(raw[1 : 1 + width], "big")
    return 1 + width, length


class _Struct:
    """One cppack struct: its values read in order by msgpack, each checked for its kind before it is read."""

    def __init__(self, raw: bytes, limits: Limits, where: str) -> None:
        self.raw = raw
        self.where = where
        self.limits = limits
        self._unpacker = msgpack.Unpacker(
            max_buffer_size=max(len(raw), 1),
            max_bin_len=len(raw),
            max_str_len=limits.max_string_bytes,
            max_array_len=max(limits.max_fragments, limits.max_actions, limits.max_ports),
            max_map_len=0,
            max_ext_len=0,
            raw=False,
            strict_map_key=True,
        )
        self._unpacker.feed(raw)

    def _peek(self, what: str) -> int:
        at = self._unpacker.tell()
        if at >= len(self.raw):
            raise invalid(f"{self.where}: truncated before {what}")
        return self.raw[at]

    def _value(self, what: str) -> Any:
        first = self._peek(what)
        if first in _ARRAYS or first in _MAPS:
            raise invalid(f"{self.where}: {what} is a msgpack container (0x{first:02x}); the layout has a value there")
        try:
            return self._unpacker.unpack()
        except msgpack.OutOfData:
            raise invalid(f"{self.where}: truncated in {what}") from None
        except UnicodeDecodeError:
            raise invalid(f"{self.where}: {what} is not UTF-8") from None
        except ValueError as exc:  # a length over a max_*_len limit, an unknown type byte
            raise self._too_large(what, exc) from None

    def _too_large(self, what: str, exc: Exception) -> Exception:
        text = str(exc)
        if "exceeds max" in text:
            return exhausted(f"{self.where}: {what} is larger than this server takes ({text})")
        return invalid(f"{self.where}: {what} does not decode: {text}")

    def at_end(self) -> bool:
        return self._unpacker.tell() >= len(self.raw)

    def string(self, what: str) -> str:
        value = self._value(what)
        if not isinstance(value, str):
            raise invalid(f"{self.where}: {what} must be a string, got {type(value).__name__}")
        return value

    def binary(self, what: str) -> bytes:
        value = self._value(what)
        if not isinstance(value, bytes):
            raise invalid(f"{self.where}: {what} must be bytes, got {type(value).__name__}")
        return value

    def integer(self, what: str, low: int, high: int) -> int:
        value = self._value(what)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"{self.where}: {what} must be an integer, got {type(value).__name__}")
        if not low <= value <= high:
            raise invalid(f"{self.where}: {what} is {value}, outside {low}..{high}")
        return value

    def boolean(self, what: str) -> bool:
        value = self._value(what)
        if not isinstance(value, bool):
            raise invalid(f"{self.where}: {what} must be a boolean, got {type(value).__name__}")
        return value

    def is_nil(self, what: str) -> bool:
        """True (and consumed) when the next value is nil."""
        if self._peek(what) == _NIL:
            self._unpacker.skip()
            return True
        return False

    def struct(self, what: str, limit: int) -> _Struct:
        """The next value as a struct of its own, its announced length checked against ``limit`` before it is read."""
        first = self._peek(what)
        if first not in _BIN:
            raise invalid(f"{self.where}: {what} must be a msgpack bin, got 0x{first:02x}")
        _, length = bin_extent(self.raw[self._unpacker.tell() :][:9], f"{self.where} {what}")
        if length > limit:
            raise exhausted(f"{self.where}: {what} holds {length} bytes; the limit is {limit}")
        return _Struct(self.binary(what), self.limits, f"{self.where} {what}")

    def items(self, what: str, limit: int, read: Callable[[_Struct, int], T]) -> tuple[T, ...]:
        """A msgpack array of structs, its length checked against ``limit`` (and the bytes left) first."""
        first = self._peek(what)
        if first not in _ARRAYS:
            raise invalid(f"{self.where}: {what} must be a msgpack array, got 0x{first:02x}")
        try:
            count = self._unpacker.read_array_header()
        except msgpack.OutOfData:
            raise invalid(f"{self.where}: truncated in the length of {what}") from None
        except ValueError as exc:
            raise self._too_large(what, exc) from None
        if count > limit:
            raise exhausted(f"{self.where}: {count} {what} in one message; the limit is {limit}")
        if count > len(self.raw) - self._unpacker.tell():
            raise invalid(f"{self.where}: {what} announces {count} items in fewer bytes")
        return tuple(read(self, i) for i in range(count))

    def pairs(self, what: str, limit: int) -> dict[str, str]:
        """cppack's map: a count, then that many string key/value pairs (attributes, headers)."""
        count = self.integer(f"{what} count", 0, limit)
        out: dict[str, str] = {}
        for i in range(count):
            key = self.string(f"{what} key {i}")
            value = self._value(f"{what} {key!r}")
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            if not isinstance(value, str):
                raise invalid(f"{self.where}: {what} {key!r} must be a string, got {type(value).__name__}")
            out[key] = value
        return out

    def finish(self) -> None:
        if not self.at_end():
            extra = len(self.raw) - self._unpacker.tell()
            raise invalid(f"{self.where}: {extra} bytes after the last field")


def decode(frame: bytes, limits: Limits, where: str) -> tuple[WireMessage, Form]:
    """One frame -> its message and the layout it was written in; a malformed frame raises GatewayError."""
    if len(frame) > limits.max_frame_bytes:
        raise exhausted(f"{where}: {len(frame)} bytes; the limit is {limits.max_frame_bytes}")
    start, length = bin_extent(frame, where)
    if start + length != len(frame):
        raise invalid(f"{where}: its bin announces {length} bytes but {len(frame) - start} follow")
    message = _Struct(frame[start:], limits, where)
    fragments = message.items("node fragments", limits.max_fragments, _fragment)
    actions = message.items("actions", limits.max_actions, _action)
    form = Form.HEAD
    headers: dict[str, bytes] = {}
    if not message.at_end():
        form = Form.RELEASE
        headers = {k: v.encode() for k, v in message.pairs("headers", limits.max_headers).items()}
    message.finish()
    return WireMessage(fragments, actions, headers), form


def _fragment(outer: _Struct, index: int) -> NodeFragment:
    limits = outer.limits
    s = outer.struct(f"fragment {index}", _chunk_limit(limits) + limits.max_string_bytes + 64)
    variant = s.integer("variant", 0, 1)
    payload: Chunk | NodeRef
    if variant == 0:
        payload = _chunk(s.struct("chunk", _chunk_limit(limits)))
    else:
        payload = _node_ref(s.struct("node ref", limits.max_string_bytes + 32))
    continued = s.boolean("continued")
    node_id = s.string("id")
    seq = None if s.is_nil("seq") else s.integer("seq", -1, 2**31 - 1)
    s.finish()
    return NodeFragment(node_id, payload, None if seq == -1 else seq, continued)


def _metadata_limit(limits: Limits) -> int:
    return (limits.max_string_bytes + 8) * (2 * limits.max_attributes + 2)


def _chunk_limit(limits: Limits) -> int:
    return limits.max_chunk_bytes + limits.max_string_bytes + _metadata_limit(limits) + 32


def _chunk(s: _Struct) -> Chunk:
    data = s.binary("data")
    if len(data) > s.limits.max_chunk_bytes:
        raise exhausted(f"{s.where}: {len(data)} bytes of data; the limit is {s.limits.max_chunk_bytes}")
    ref = s.string("ref")
    metadata = None
    if not s.is_nil("metadata"):
        m = s.struct("metadata", _metadata_limit(s.limits))
        mimetype = m.string("mimetype")
        timestamp = None if m.is_nil("timestamp") else m.integer("timestamp", -(2**63), 2**63 - 1)
        attributes = m.pairs("attributes", s.limits.max_attributes)
        m.finish()
        metadata = ChunkMetadata(mimetype, timestamp, attributes)
    s.finish()
    return Chunk(data, ref, metadata)


def _node_ref(s: _Struct) -> NodeRef:
    node_id = s.string("id")
    offset = s.integer("offset", 0, 2**32 - 1)
    length = None if s.is_nil("length") else s.integer("length", 0, 2**32 - 1)
    s.finish()
    return NodeRef(node_id, offset, length)


def _action(outer: _Struct, index: int) -> ActionMessage:
    limits = outer.limits
    s = outer.struct(
        f"action {index}", (limits.max_string_bytes + 8) * (4 * limits.max_ports + 2 * limits.max_headers + 2)
    )
    action_id = s.string("id")
    name = s.string("name")
    inputs = s.items("inputs", limits.max_ports, _port)
    outputs = s.items("outputs", limits.max_ports, _port)
    headers: dict[str, bytes] = {}
    if not s.at_end():
        headers = {k: v.encode() for k, v in s.pairs("headers", limits.max_headers).items()}
    s.finish()
    return ActionMessage(action_id, name, inputs, outputs, headers)


def _port(outer: _Struct, index: int) -> Port:
    s = outer.struct(f"port {index}", 2 * outer.limits.max_string_bytes + 16)
    port = Port(s.string("name"), s.string("id"))
    s.finish()
    return port


# -- writing ---------------------------------------------------------------------


def integer(value: int) -> bytes:
    """A signed integer the way cppack packs one (its reader takes only the signed forms)."""
    if 0 <= value < 128 or -32 <= value < 0:
        return value.to_bytes(1, "big", signed=True)
    for marker, width in ((0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
        if -(1 << (8 * width - 1)) <= value < (1 << (8 * width - 1)):
            return bytes([marker]) + value.to_bytes(width, "big", signed=True)
    raise ValueError(f"{value} does not fit in 64 bits")


def _bin(data: bytes) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


def _str(text: str) -> bytes:
    return msgpack.packb(text, use_bin_type=True)


def _array(items: list[bytes]) -> bytes:
    return msgpack.Packer().pack_array_header(len(items)) + b"".join(items)


def _pairs(values: dict[str, str]) -> bytes:
    return integer(len(values)) + b"".join(_str(k) + _str(v) for k, v in values.items())


def encode_chunk(chunk: Chunk) -> bytes:
    out = _bin(chunk.data) + _str(chunk.ref)
    if chunk.metadata is None:
        return out + b"\xc0"
    m = chunk.metadata
    timestamp = b"\xc0" if m.timestamp_us is None else integer(m.timestamp_us)
    return out + _bin(_str(m.mimetype) + timestamp + _pairs(m.attributes))


def encode_fragment(fragment: NodeFragment) -> bytes:
    if not isinstance(fragment.data, Chunk):
        raise ValueError("the server writes chunks only")
    seq = b"\xc0" if fragment.seq is None else integer(fragment.seq)
    body = integer(0) + _bin(encode_chunk(fragment.data)) + (b"\xc3" if fragment.continued else b"\xc2")
    return _bin(body + _str(fragment.id) + seq)


def encode(fragments: list[bytes], form: Form) -> bytes:
    """A frame of already encoded fragments (no actions: the server sends none), in the client's layout."""
    body = _array(fragments) + _array([])
    if form is Form.RELEASE:
        body += integer(0)
    return _bin(body)
