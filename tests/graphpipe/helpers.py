"""Request buffers built by the real GraphPipe client, and response readers."""

from __future__ import annotations

from typing import Any

import numpy as np
from graphpipe import convert

from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp


def infer_buffer(
    inputs: list[np.ndarray],
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    config: str | None = None,
) -> bytes:
    """Exactly the bytes ``graphpipe.remote.execute_multi`` would POST."""
    return bytes(convert.serialize_infer_request(convert.InferReq(config, inputs, input_names, output_names)))


def metadata_buffer() -> bytes:
    return bytes(convert.serialize_metadata_request())


def read_response(body: bytes) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """(outputs, errors) as the reference Python client decodes them."""
    outputs, errors = convert.deserialize_infer_response(body)
    return outputs, errors


def read_tensor_fields(body: bytes) -> list[tuple[int, bool, bool]]:
    """(type, shape present, data present) of every output tensor, read with our generated code."""
    response = gp.InferResponse.GetRootAs(body, 0)
    out = []
    for i in range(response.OutputTensorsLength()):
        t = response.OutputTensors(i)
        out.append((t.Type(), not t.ShapeIsNone(), not t.DataIsNone()))
    return out
