"""Decoding requests from the real client's bytes, verifying hostile buffers, encoding answers."""

from __future__ import annotations

import struct

import flatbuffers
import numpy as np
import pytest

from prismgate.codecs.graphpipe import wire
from prismgate.codecs.graphpipe.verify import verify_request
from prismgate.core.errors import Code, GatewayError
from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp
from tests.graphpipe.helpers import infer_buffer, metadata_buffer, read_response, read_tensor_fields


def test_decodes_the_python_clients_infer_request() -> None:
    body = infer_buffer(
        [np.array(["héllo", "x"]), np.array([[1, 2, -1]], dtype=np.int32)],
        ["prompt", "tokens"],
        ["text", "lengths"],
        config='{"max_tokens": 3}',
    )
    call = wire.decode_request(body)
    assert call is not None
    assert call.config == b'{"max_tokens": 3}'
    assert call.input_names == ["prompt", "tokens"] and call.output_names == ["text", "lengths"]
    prompt, tokens = call.inputs
    assert prompt.type == gp.Type.String and prompt.shape == (2,) and prompt.strings == ["héllo".encode(), b"x"]
    assert tokens.type == gp.Type.Int32 and tokens.shape == (1, 3)
    assert tokens.values is not None and tokens.values.tolist() == [[1, 2, -1]]


def test_empty_names_and_config_are_the_defaults() -> None:
    call = wire.decode_request(infer_buffer([np.array("scalar")]))
    assert call is not None
    assert call.config == b"" and call.input_names == [] and call.output_names == []
    assert call.inputs[0].shape == () and call.inputs[0].strings == [b"scalar"]


def test_metadata_and_unknown_request_types_decode_to_none() -> None:
    assert wire.decode_request(metadata_buffer()) is None
    b = flatbuffers.Builder(64)
    gp.RequestStart(b)
    gp.RequestAddReqType(b, 7)  # not a member of the union: the reference servers answer metadata
    b.Finish(gp.RequestEnd(b))
    assert wire.decode_request(bytes(b.Output())) is None


def _error(body: bytes) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        wire.decode_request(body)
    assert info.value.code == Code.INVALID_ARGUMENT and info.value.message
    return info.value


def test_every_truncation_of_a_valid_request_is_a_clear_error() -> None:
    body = infer_buffer([np.array(["hello"])], ["prompt"], ["text"], config="{}")
    meaningful = len(body.rstrip(b"\0")) + 1  # up to the last string's NUL; the rest is alignment padding
    assert meaningful < len(body)
    for n in range(meaningful):
        err = _error(body[:n])
        assert "malformed GraphPipe request" in err.message
    for n in range(meaningful, len(body) + 1):
        call = wire.decode_request(body[:n])
        assert call is not None and call.inputs[0].strings == [b"hello"]


def test_garbage_is_a_clear_error() -> None:
    assert "too short" in _error(b"").message
    assert "outside the buffer" in _error(b"\xff" * 64).message


def test_wrong_data_size_for_the_shape() -> None:
    body = bytearray(infer_buffer([np.array([[1, 2, 3]], dtype=np.int64)], ["tokens"]))
    shape_at = bytes(body).find(struct.pack("<qq", 1, 3))
    body[shape_at + 8 : shape_at + 16] = struct.pack("<q", 4)  # claim 4 columns, keep 3 values
    assert "needs 32 bytes of data but the tensor has 24" in _error(bytes(body)).message


def test_negative_dimension_and_string_count() -> None:
    body = bytearray(infer_buffer([np.array(["a", "b"])], ["prompt"]))
    at = bytes(body).find(struct.pack("<q", 2))
    body[at : at + 8] = struct.pack("<q", -2)
    assert "negative dimension" in _error(bytes(body)).message
    body[at : at + 8] = struct.pack("<q", 3)
    assert "holds 3 strings but string_val has 2" in _error(bytes(body)).message


def test_aliased_offsets_cannot_amplify_a_small_buffer() -> None:
    b = flatbuffers.Builder(1 << 20)
    big = b.CreateString(b"x" * 100_000)
    gp.TensorStartStringValVector(b, 1000)
    for _ in range(1000):  # a thousand entries, all pointing at the same 100 kB string
        b.PrependUOffsetTRelative(big)
    strings = b.EndVector(1000)
    gp.TensorStart(b)
    gp.TensorAddType(b, gp.Type.String)
    gp.TensorAddStringVal(b, strings)
    tensor = gp.TensorEnd(b)
    gp.InferRequestStartInputTensorsVector(b, 1)
    b.PrependUOffsetTRelative(tensor)
    tensors = b.EndVector(1)
    gp.InferRequestStart(b)
    gp.InferRequestAddInputTensors(b, tensors)
    infer = gp.InferRequestEnd(b)
    gp.RequestStart(b)
    gp.RequestAddReqType(b, gp.Req.InferRequest)
    gp.RequestAddReq(b, infer)
    b.Finish(gp.RequestEnd(b))
    assert "far more data than it holds" in _error(bytes(b.Output())).message


def test_infer_request_type_without_its_table() -> None:
    b = flatbuffers.Builder(64)
    gp.RequestStart(b)
    gp.RequestAddReqType(b, gp.Req.InferRequest)
    b.Finish(gp.RequestEnd(b))
    assert "InferRequest is missing" in _error(bytes(b.Output())).message


def test_verify_accepts_what_it_should() -> None:
    assert verify_request(metadata_buffer()) == gp.Req.MetadataRequest
    assert verify_request(infer_buffer([np.zeros((0, 3), np.int32)], ["tokens"])) == gp.Req.InferRequest


def test_outputs_always_carry_type_shape_and_data() -> None:
    tensors = [
        wire.OutTensor.of_strings([b"a", b""]),
        wire.OutTensor.of(gp.Type.Int32, np.zeros((2, 0), np.int32)),
        wire.OutTensor.of(gp.Type.Float32, np.full((1, 2, 3), np.nan, np.float32)),
    ]
    body = wire.encode_outputs(tensors)
    assert read_tensor_fields(body) == [
        (gp.Type.String, True, True),
        (gp.Type.Int32, True, True),
        (gp.Type.Float32, True, True),
    ]
    outputs, errors = read_response(body)
    assert errors == []
    assert outputs[0].tolist() == [b"a", b""]
    assert outputs[1].shape == (2, 0) and outputs[1].dtype == np.int32
    assert outputs[2].shape == (1, 2, 3) and np.isnan(outputs[2]).all()


def test_error_response_reads_back_in_the_client() -> None:
    outputs, errors = read_response(wire.encode_errors([(3, "bad config")]))
    assert outputs == [] and errors == [{"code": 3, "message": b"bad config"}]


def test_metadata_json_uses_the_reference_key_style() -> None:
    meta = wire.Metadata("m", "1", "s", "d", (wire.IOSpec("prompt", "p", (-1,), gp.Type.String),), ())
    assert wire.metadata_json(meta) == {
        "Name": "m",
        "Version": "1",
        "Server": "s",
        "Description": "d",
        "Inputs": [{"Name": "prompt", "Description": "p", "Shape": [-1], "Type": 12}],
        "Outputs": [],
    }
