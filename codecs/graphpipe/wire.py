"""GraphPipe flatbuffers <-> plain Python values, through the generated code.

Decoding runs only on buffers :func:`verify_request` accepted, and then checks what the
schema cannot express: a known tensor type, a shape whose element count matches the data,
``data`` and ``string_val`` not both set, UTF-8 names. Encoding always writes a tensor's
type, shape and data (data even when empty), because the reference Python client reads
all three; it never writes Type Null.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import flatbuffers
import numpy as np
import numpy.typing as npt

from prismgate.codecs.graphpipe.verify import REQ_INFER, verify_request
from prismgate.core.errors import invalid
from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp

T = gp.Type
TYPE_NAMES = {v: k for k, v in vars(T).items() if not k.startswith("_")}
DTYPES: dict[int, np.dtype] = {
    T.Uint8: np.dtype("<u1"),
    T.Int8: np.dtype("<i1"),
    T.Uint16: np.dtype("<u2"),
    T.Int16: np.dtype("<i2"),
    T.Uint32: np.dtype("<u4"),
    T.Int32: np.dtype("<i4"),
    T.Uint64: np.dtype("<u8"),
    T.Int64: np.dtype("<i8"),
    T.Float16: np.dtype("<f2"),
    T.Float32: np.dtype("<f4"),
    T.Float64: np.dtype("<f8"),
}
INTEGER_TYPES = frozenset({T.Uint8, T.Int8, T.Uint16, T.Int16, T.Uint32, T.Int32, T.Uint64, T.Int64})
MAX_RANK = 8  # more dimensions than any input here needs (numpy itself stops at 64)
# numpy refuses a shape of 2**63 bytes or more, even an empty one: at 8-byte elements, 2**60
MAX_ELEMENTS = 2**60
DATA_ALIGN = 16  # tensor data starts 16-byte aligned in the buffers we write, so clients can view it in place


def type_name(t: int) -> str:
    return TYPE_NAMES.get(t, f"unknown type {t}")


@dataclass(slots=True)
class WireTensor:
    """One decoded tensor: numeric ``values`` (a numpy array in ``shape``) or ``strings``."""

    type: int
    shape: tuple[int, ...]
    values: npt.NDArray[np.generic] | None = None
    strings: list[bytes] = field(default_factory=list)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class InferCall:
    """An InferRequest: empty name lists mean "the defaults" (the client always sends the vectors)."""

    config: bytes
    input_names: list[str]
    inputs: list[WireTensor]
    output_names: list[str]


# -- decoding -----------------------------------------------------------------------------


def decode_request(body: bytes, max_strings: int | None = None) -> InferCall | None:
    """Verify and decode a Request; None means "answer with metadata" (any non-infer type).

    ``max_strings`` caps the elements of a String tensor, checked from the vector's
    length before any element is decoded (each one becomes a Python object).
    """
    if verify_request(body) != REQ_INFER:
        return None
    request = gp.Request.GetRootAs(body, 0)
    table = request.Req()
    infer = gp.InferRequest()
    infer.Init(table.Bytes, table.Pos)
    return InferCall(
        config=infer.Config() or b"",
        input_names=_names(infer.InputNames, infer.InputNamesLength(), "input_names"),
        inputs=[_tensor(infer.InputTensors(i), i, max_strings) for i in range(infer.InputTensorsLength())],
        output_names=_names(infer.OutputNames, infer.OutputNamesLength(), "output_names"),
    )


def _names(get: Callable[[int], bytes], count: int, what: str) -> list[str]:
    names = []
    for i in range(count):
        raw = get(i)
        try:
            names.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise invalid(f"{what}[{i}] is not valid UTF-8: {raw[:40]!r}") from None
    return names


def _tensor(t: gp.Tensor, index: int, max_strings: int | None) -> WireTensor:
    where = f"input tensor {index}"
    kind = t.Type()
    rank = t.ShapeLength()
    if rank > MAX_RANK:
        raise invalid(f"{where}: shape has {rank} dimensions; at most {MAX_RANK} are supported")
    shape = tuple(int(d) for d in t.ShapeAsNumpy()) if rank else ()
    if any(d < 0 for d in shape):
        raise invalid(f"{where}: shape {list(shape)} has a negative dimension")
    if math.prod(d for d in shape if d) >= MAX_ELEMENTS:  # a zero dimension must not hide the others
        raise invalid(f"{where}: shape {list(shape)} multiplies out to 2**60 elements or more")
    size = math.prod(shape)
    n_strings, n_data = t.StringValLength(), t.DataLength()
    if kind == T.String:
        if n_data:
            raise invalid(f"{where}: a String tensor must keep data empty (it has {n_data} bytes)")
        if n_strings != size:
            raise invalid(f"{where}: shape {list(shape)} holds {size} strings but string_val has {n_strings}")
        if max_strings is not None and n_strings > max_strings:
            raise invalid(
                f"{where}: {n_strings} strings; this server takes at most {max_strings} rows (graphpipe_max_batch)"
            )
        return WireTensor(kind, shape, strings=[t.StringVal(i) for i in range(n_strings)])
    dtype = DTYPES.get(kind)
    if dtype is None:
        raise invalid(f"{where}: tensor type {type_name(kind)} is not a data type (expected 1..12)")
    if n_strings:
        raise invalid(f"{where}: a {type_name(kind)} tensor must keep string_val empty (it has {n_strings})")
    if n_data != size * dtype.itemsize:
        raise invalid(
            f"{where}: shape {list(shape)} of {type_name(kind)} needs {size * dtype.itemsize} bytes "
            f"of data but the tensor has {n_data}"
        )
    raw = t.DataAsNumpy() if n_data else np.zeros(0, np.uint8)
    return WireTensor(kind, shape, values=raw.view(dtype).reshape(shape))


# -- encoding -----------------------------------------------------------------------------


@dataclass(slots=True)
class OutTensor:
    """A tensor to send: ``array`` for numeric types, ``strings`` for Type String."""

    type: int
    shape: tuple[int, ...]
    array: npt.NDArray[np.generic] | None = None
    strings: Sequence[bytes] = ()

    @classmethod
    def of(cls, kind: int, array: npt.ArrayLike) -> OutTensor:
        values = np.ascontiguousarray(array, dtype=DTYPES[kind])
        return cls(kind, tuple(values.shape), array=values)

    @classmethod
    def of_strings(cls, strings: Sequence[bytes], shape: tuple[int, ...] | None = None) -> OutTensor:
        return cls(T.String, shape if shape is not None else (len(strings),), strings=list(strings))


def _int64_vector(b: flatbuffers.Builder, values: Sequence[int]) -> int:
    return int(b.CreateNumpyVector(np.asarray(values, dtype="<i8").reshape(-1)))


def _offset_vector(b: flatbuffers.Builder, offsets: Sequence[int]) -> int:
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector(len(offsets)))


def _byte_vector(b: flatbuffers.Builder, data: bytes) -> int:
    n = len(data)
    b.StartVector(1, n, DATA_ALIGN)
    b.head = b.head - n
    b.Bytes[b.head : b.head + n] = data
    return int(b.EndVector(n))


def _write_tensor(b: flatbuffers.Builder, t: OutTensor) -> int:
    if t.type == T.Null:
        raise ValueError("never send Type Null")
    shape = _int64_vector(b, t.shape)
    strings = None
    if t.type == T.String:
        strings = _offset_vector(b, [b.CreateString(bytes(s)) for s in t.strings])
        data = _byte_vector(b, b"")
    else:
        assert t.array is not None
        data = _byte_vector(b, t.array.tobytes())
    gp.TensorStart(b)
    gp.TensorAddType(b, t.type)
    gp.TensorAddShape(b, shape)
    gp.TensorAddData(b, data)
    if strings is not None:
        gp.TensorAddStringVal(b, strings)
    return int(gp.TensorEnd(b))


def _size_hint(tensors: Sequence[OutTensor]) -> int:
    return 1024 + sum(
        (t.array.nbytes if t.array is not None else 0) + sum(len(s) + 8 for s in t.strings) for t in tensors
    )


def encode_outputs(tensors: Sequence[OutTensor]) -> bytes:
    b = flatbuffers.Builder(_size_hint(tensors))
    offsets = [_write_tensor(b, t) for t in tensors]
    vector = _offset_vector(b, offsets)
    gp.InferResponseStart(b)
    gp.InferResponseAddOutputTensors(b, vector)
    b.Finish(gp.InferResponseEnd(b))
    return bytes(b.Output())


def encode_errors(errors: Sequence[tuple[int, str]]) -> bytes:
    """An InferResponse carrying only ``errors`` (the spec: data in one of the two fields)."""
    b = flatbuffers.Builder(256 + sum(len(m) for _, m in errors))
    offsets = []
    for code, message in errors:
        text = b.CreateString(message)
        gp.ErrorStart(b)
        gp.ErrorAddCode(b, code)
        gp.ErrorAddMessage(b, text)
        offsets.append(gp.ErrorEnd(b))
    vector = _offset_vector(b, offsets)
    gp.InferResponseStart(b)
    gp.InferResponseAddErrors(b, vector)
    b.Finish(gp.InferResponseEnd(b))
    return bytes(b.Output())


@dataclass(frozen=True, slots=True)
class IOSpec:
    name: str
    description: str
    shape: tuple[int, ...]
    type: int


@dataclass(frozen=True, slots=True)
class Metadata:
    name: str
    version: str
    server: str
    description: str
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]


def _write_io(b: flatbuffers.Builder, io: IOSpec) -> int:
    name, description = b.CreateString(io.name), b.CreateString(io.description)
    shape = _int64_vector(b, io.shape)
    gp.IOMetadataStart(b)
    gp.IOMetadataAddName(b, name)
    gp.IOMetadataAddDescription(b, description)
    gp.IOMetadataAddShape(b, shape)
    gp.IOMetadataAddType(b, io.type)
    return int(gp.IOMetadataEnd(b))


def encode_metadata(meta: Metadata) -> bytes:
    b = flatbuffers.Builder(4096)
    strings = [b.CreateString(s) for s in (meta.name, meta.version, meta.server, meta.description)]
    inputs = _offset_vector(b, [_write_io(b, io) for io in meta.inputs])
    outputs = _offset_vector(b, [_write_io(b, io) for io in meta.outputs])
    gp.MetadataResponseStart(b)
    gp.MetadataResponseAddName(b, strings[0])
    gp.MetadataResponseAddVersion(b, strings[1])
    gp.MetadataResponseAddServer(b, strings[2])
    gp.MetadataResponseAddDescription(b, strings[3])
    gp.MetadataResponseAddInputs(b, inputs)
    gp.MetadataResponseAddOutputs(b, outputs)
    b.Finish(gp.MetadataResponseEnd(b))
    return bytes(b.Output())


def metadata_json(meta: Metadata) -> dict[str, object]:
    """The GET answer, in the reference servers' key style (Go field names, numeric Type)."""

    def io(x: IOSpec) -> dict[str, object]:
        return {"Name": x.name, "Description": x.description, "Shape": list(x.shape), "Type": x.type}

    return {
        "Name": meta.name,
        "Version": meta.version,
        "Server": meta.server,
        "Description": meta.description,
        "Inputs": [io(x) for x in meta.inputs],
        "Outputs": [io(x) for x in meta.outputs],
    }
