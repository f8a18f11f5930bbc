"""Bounds-check a GraphPipe ``Request`` buffer before anything reads it.

The flatbuffers Python runtime trusts every offset it follows: a hostile buffer makes it raise
a bare ``struct.error``, return garbage, or (through aliased offsets) expand a small body into
gigabytes of strings. This module walks the request exactly as the generated readers will, with
the checks of the C++ ``flatbuffers::Verifier`` and a budget on the bytes strings and vectors
decode to, and rejects, saying where, anything out of bounds; its work is linear in the
buffer's size. What it checks: docs/graphpipe.md, "Errors".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from prismgate.core.errors import GatewayError, invalid

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")

REQ_INFER = 1  # union Req: NONE=0, InferRequest=1, MetadataRequest=2
REQ_METADATA = 2
AMPLIFICATION = 4  # decoded bytes allowed per buffer byte (aliased strings are legal but bounded)


@dataclass(frozen=True, slots=True)
class _Table:
    pos: int
    vtable: int
    vtable_size: int
    size: int


class _Verifier:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.end = len(buf)
        self.budget = AMPLIFICATION * len(buf) + 1024

    def _fail(self, what: str, detail: str) -> GatewayError:
        return invalid(f"malformed GraphPipe request: {what}: {detail} (buffer is {self.end} bytes)")

    def _in(self, pos: int, size: int, what: str) -> None:
        if pos < 0 or pos + size > self.end:
            raise self._fail(what, f"[{pos}, {pos + size}) lies outside the buffer")

    def _u32(self, pos: int, what: str) -> int:
        self._in(pos, 4, what)
        return int(_U32.unpack_from(self.buf, pos)[0])

    def _charge(self, nbytes: int, what: str) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise self._fail(what, "the buffer refers to far more data than it holds (aliased offsets)")

    def table(self, pos: int, what: str) -> _Table:
        self._in(pos, 4, what)
        vtable = pos - int(_I32.unpack_from(self.buf, pos)[0])
        self._in(vtable, 4, f"{what} vtable")
        vtable_size, size = _U16.unpack_from(self.buf, vtable)[0], _U16.unpack_from(self.buf, vtable + 2)[0]
        if vtable_size < 4 or vtable_size % 2:
            raise self._fail(what, f"vtable size {vtable_size} is not an even number >= 4")
        self._in(vtable, vtable_size, f"{what} vtable")
        if size < 4:
            raise self._fail(what, f"table size {size} is smaller than its vtable offset")
        self._in(pos, size, what)
        self._charge(size, what)
        return _Table(pos, vtable, vtable_size, size)

    def field(self, table: _Table, slot: int, size: int, what: str) -> int | None:
        """The absolute position of a present field, or None when it is absent."""
        entry = 4 + 2 * slot
        if entry >= table.vtable_size:
            return None
        offset = int(_U16.unpack_from(self.buf, table.vtable + entry)[0])
        if offset == 0:
            return None
        if offset < 4 or offset + size > table.size:
            raise self._fail(
                what, f"field at table offset {offset} (+{size} bytes) lies outside its {table.size}-byte table"
            )
        return table.pos + offset

    def _target(self, field_pos: int, what: str) -> int:
        return field_pos + self._u32(field_pos, what)

    def vector(self, field_pos: int, elem_size: int, what: str) -> tuple[int, int]:
        """(start of the elements, element count) of the vector a field points to."""
        at = self._target(field_pos, what)
        count = self._u32(at, f"{what} length")
        nbytes = count * elem_size
        if at + 4 + nbytes > self.end:
            raise self._fail(what, f"vector of {count} x {elem_size} bytes at {at} runs past the end")
        self._charge(nbytes + 4, what)
        return at + 4, count

    def string(self, field_pos: int, what: str) -> None:
        start, count = self.vector(field_pos, 1, what)
        if start + count >= self.end or self.buf[start + count] != 0:
            raise self._fail(what, f"string of {count} bytes at {start} has no NUL terminator")

    def sub_table(self, field_pos: int, what: str) -> _Table:
        return self.table(self._target(field_pos, what), what)

    def strings(self, table: _Table, slot: int, what: str) -> None:
        at = self.field(table, slot, 4, what)
        if at is None:
            return
        start, count = self.vector(at, 4, what)
        for i in range(count):
            self.string(start + 4 * i, f"{what}[{i}]")

    # -- the schema --------------------------------------------------------------------

    def request(self) -> int:
        if self.end < 8:
            raise invalid(
                f"malformed GraphPipe request: the body is {self.end} bytes, too short for a flatbuffer "
                "(POST a flatbuffer-encoded graphpipe.Request; GET returns the metadata as JSON)"
            )
        root = self.table(self._u32(0, "root offset"), "Request")
        type_pos = self.field(root, 0, 1, "Request.req_type")
        req_type = 0 if type_pos is None else self.buf[type_pos]
        req_pos = self.field(root, 1, 4, "Request.req")
        if req_type == REQ_INFER:
            if req_pos is None:
                raise self._fail("Request.req", "req_type is InferRequest but the InferRequest is missing")
            self.infer_request(self.sub_table(req_pos, "InferRequest"))
        elif req_type == REQ_METADATA and req_pos is not None:
            self.sub_table(req_pos, "MetadataRequest")
        return req_type

    def infer_request(self, table: _Table) -> None:
        config = self.field(table, 0, 4, "InferRequest.config")
        if config is not None:
            self.string(config, "InferRequest.config")
        self.strings(table, 1, "InferRequest.input_names")
        tensors = self.field(table, 2, 4, "InferRequest.input_tensors")
        if tensors is not None:
            start, count = self.vector(tensors, 4, "InferRequest.input_tensors")
            for i in range(count):
                self.tensor(self.sub_table(start + 4 * i, f"input_tensors[{i}]"), f"input_tensors[{i}]")
        self.strings(table, 3, "InferRequest.output_names")

    def tensor(self, table: _Table, what: str) -> None:
        self.field(table, 0, 1, f"{what}.type")
        shape = self.field(table, 1, 4, f"{what}.shape")
        if shape is not None:
            self.vector(shape, 8, f"{what}.shape")
        data = self.field(table, 2, 4, f"{what}.data")
        if data is not None:
            self.vector(data, 1, f"{what}.data")
        self.strings(table, 3, f"{what}.string_val")


def verify_request(buf: bytes) -> int:
    """Check ``buf`` is a well-formed ``graphpipe.Request``; return its ``req_type``.

    Raises ``GatewayError(INVALID_ARGUMENT)`` naming the first field that is out of bounds.
    Only the union member that will be read is verified: any type other than
    InferRequest is answered with metadata, so its body is never followed.
    """
    return _Verifier(buf).request()
