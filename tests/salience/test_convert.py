"""The wire <-> core translation, without a server: defaults, mappings, layouts."""

from __future__ import annotations

import numpy as np
import pytest

from prismgate.codecs.salience import convert
from prismgate.core.actions import PositionRange
from prismgate.core.engine import ReadoutManifest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, FinishReason, TokenEvent
from prismgate.schemas import salience_pb2 as pb

Finish = pb.GenerateDone.FinishReason


def test_zero_sampling_fields_take_the_documented_defaults() -> None:
    spec = convert.spec_from_request(pb.GenerateRequest(max_tokens=3))
    assert (spec.temperature, spec.top_p, spec.top_k) == (1.0, 1.0, 0)
    assert spec.max_tokens == 3 and spec.priority == 0


def test_sampling_fields_are_copied_when_set() -> None:
    request = pb.GenerateRequest(
        temperature=0.5,
        top_p=0.25,
        top_k=7,
        stop_token_ids=[5, 9],
        priority=10,
        logprob_top_k=4,
        logprobs_ranges=[pb.PositionRange(start=1, end=3)],
        readout_ranges=[pb.PositionRange(start=0, end=2)],
    )
    spec = convert.spec_from_request(request)
    assert spec.temperature == 0.5 and spec.top_p == 0.25 and spec.top_k == 7
    assert spec.stop_token_ids == (5, 9) and spec.priority == 10 and spec.logprob_top_k == 4
    assert spec.logprob_ranges == (PositionRange(1, 3),) and spec.readout_ranges == (PositionRange(0, 2),)


def test_action_carries_offset_truncation_images_and_origin() -> None:
    request = pb.GenerateRequest(
        append_tokens=[1, 2, 3],
        offset=7,
        truncating=True,
        images=[pb.ImageAttachment(bytes=b"png", mime="image/png", pad_range_start=7, pad_range_end=10)],
    )
    action = convert.action_from_request(request)
    assert action.append_tokens == (1, 2, 3) and action.offset == 7 and action.truncating
    assert action.origin == "salience"
    (image,) = action.images
    assert (image.data, image.mime, image.start, image.end) == (b"png", "image/png", 7, 10)


def test_bad_values_fail_in_the_core_as_invalid_argument() -> None:
    with pytest.raises(GatewayError) as caught:
        convert.spec_from_request(pb.GenerateRequest(top_p=1.5))
    assert caught.value.code is Code.INVALID_ARGUMENT
    with pytest.raises(GatewayError) as caught:
        convert.spec_from_request(pb.GenerateRequest(readout_ranges=[pb.PositionRange(start=4, end=2)]))
    assert caught.value.code is Code.INVALID_ARGUMENT


def test_readout_is_flattened_row_major_layers_then_concepts() -> None:
    readout = np.arange(6, dtype=np.float32).reshape(2, 3)  # [n_layers=2][n_concepts=3]
    event = convert.token_event(TokenEvent(id=5, position=9, is_prefill=True, readout=readout))
    assert list(event.token.readout) == [0, 1, 2, 3, 4, 5]
    assert event.token.id == 5 and event.token.position == 9 and event.token.is_prefill


def test_logprobs_only_when_computed() -> None:
    bare = convert.token_event(TokenEvent(id=1, position=0, is_prefill=False)).token
    assert not bare.has_sampled_logprob and not bare.logprobs and not bare.readout
    full = convert.token_event(
        TokenEvent(id=1, position=3, is_prefill=False, logprob=-0.5, top_logprobs=[(1, -0.5), (8, -1.25)])
    ).token
    assert full.has_sampled_logprob and full.sampled_logprob == -0.5
    assert [(t.id, t.logprob) for t in full.logprobs] == [(1, -0.5), (8, -1.25)]


@pytest.mark.parametrize(
    ("reason", "wire"),
    [
        (FinishReason.EOS, Finish.FINISH_REASON_EOS),
        (FinishReason.LENGTH, Finish.FINISH_REASON_LENGTH),
        (FinishReason.CANCELLED, Finish.FINISH_REASON_CANCELLED),
        (FinishReason.STOP_STRING, Finish.FINISH_REASON_STOP_STRING),
        (FinishReason.PREFILL_ONLY, Finish.FINISH_REASON_LENGTH),
    ],
)
def test_finish_reasons(reason: FinishReason, wire: int) -> None:
    done = convert.done_event(Done(prompt_tokens=4, completion_tokens=2, finish_reason=reason)).done
    assert done.finish_reason == wire
    assert (done.prompt_tokens, done.completion_tokens, done.total_tokens) == (4, 2, 6)


def test_every_core_finish_reason_has_a_wire_value() -> None:
    assert set(convert.FINISH_REASONS) == set(FinishReason)


def test_manifest() -> None:
    manifest = convert.manifest(ReadoutManifest(concepts=("a", "b"), layers=(3, 7), hidden_size=64))
    assert list(manifest.concepts) == ["a", "b"] and list(manifest.layers) == [3, 7]
    assert manifest.hidden_size == 64 and manifest.dtype == "float32"
    assert convert.manifest(None) == pb.ReadoutManifest()
