"""Numbers as base64 of little-endian floats: the binary form the JSON wires offer for readouts.

Why: a readout is layers x concepts float32 values for every token (64 with the default
pack), and printing them as JSON text is most of what a stream with readouts costs the
front-end. Their bytes, in base64, cost a fraction of that and are exact (docs/benchmarks.md,
"Readouts on the wire"). The choice is modelled on OpenAI embeddings'
``encoding_format: "base64"``: the default is the text every client already reads; a
client that asks gets little-endian float32 (or float16, half the bytes, on request) in
row-major order, as ``numpy.frombuffer(base64.b64decode(s), "<f4")`` reads them.

Each codec names the request fields its way; what the values mean and how they are
checked is here, once.
"""

from __future__ import annotations

import base64

import numpy as np

from prismgate.core.errors import Code, GatewayError

TEXT = "float"  # the default encoding_format: JSON numbers
BASE64 = "base64"
ENCODINGS = (TEXT, BASE64)
DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
INT32 = np.dtype("<i4")  # token ids beside base64 logprobs


class BadEncoding(GatewayError):
    """An encoding field a client got wrong; ``field`` is the request field to name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(Code.INVALID_ARGUMENT, message)
        self.field = field


def read_encoding(encoding: object, dtype: object, encoding_field: str, dtype_field: str) -> np.dtype | None:
    """The dtype of the base64 form a client asked for, or None for JSON numbers (the default).

    ``encoding`` and ``dtype`` are the raw request values (None: not given). A ``dtype``
    only means something with ``base64``: given with text it is refused rather than ignored.
    """
    if encoding is None:
        encoding = TEXT
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise BadEncoding(encoding_field, f"'{encoding_field}' must be 'float' or 'base64', got {encoding!r}")
    if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPES):
        raise BadEncoding(dtype_field, f"'{dtype_field}' must be 'float32' or 'float16', got {dtype!r}")
    if encoding == TEXT:
        if dtype is not None:
            raise BadEncoding(dtype_field, f"'{dtype_field}' applies only with '{encoding_field}': 'base64'")
        return None
    chosen: np.dtype = DTYPES["float32" if dtype is None else str(dtype)]
    return chosen


def dtype_name(dtype: np.dtype) -> str:
    """``float32`` or ``float16``: how the wire names a dtype of :data:`DTYPES`."""
    return "float16" if dtype.itemsize == 2 else "float32"


def b64(values: np.ndarray, dtype: np.dtype) -> str:
    """``values`` (any shape, row-major) as base64 of ``dtype``; past float16's range is +-inf."""
    if values.dtype != dtype:
        with np.errstate(over="ignore"):
            values = values.astype(dtype)
    return base64.b64encode(values.tobytes()).decode("ascii")
