"""The vLLM engine's parts that need no vLLM: side-channel framing, the session value store,
image-run collapsing and image token counts. These run in every environment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prismgate.core.engine import VisionTokens
from prismgate.core.errors import GatewayError
from prismgate.core.session import ImageSpan
from prismgate.engines.vllm.channel import StepPacket, decode_step, encode_step
from prismgate.engines.vllm.events import decode_logprob
from prismgate.engines.vllm.plan import ranges
from prismgate.engines.vllm.store import SessionValues, ValueStore
from prismgate.engines.vllm.vision import ImageCounter, collapse
from tests.vision_model import IMAGE_PAD, VISION_END, VISION_START, build_tiny_qwen2_vl, image_bytes, vision_block


def test_step_packets_round_trip() -> None:
    packet = StepPacket(step=7)
    ro = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    packet.add("pg1", np.array([10, 11, 12, 13]), ro, [(11, -1.5, [3, 4], [-0.5, -1.0])])
    packet.add("pg2", np.array([99]), None, [])
    back = decode_step(encode_step(packet))
    assert back.step == 7 and [r.key for r in back.requests] == ["pg1", "pg2"]
    assert back.requests[0].positions.tolist() == [10, 11, 12, 13]
    assert back.requests[0].readouts is not None and np.array_equal(back.requests[0].readouts, ro)
    assert back.requests[0].logprobs == [(11, -1.5, [3, 4], [-0.5, -1.0])]
    assert back.requests[1].readouts is None and back.requests[1].positions.tolist() == [99]


def test_a_truncated_packet_is_refused() -> None:
    packet = StepPacket(step=1)
    packet.add("pg1", np.array([1, 2]), np.zeros((2, 1, 1), np.float32), [])
    frames = encode_step(packet)
    with pytest.raises(ValueError):
        decode_step(frames[:-1])


def test_store_keeps_only_what_the_new_timeline_still_shares() -> None:
    store = ValueStore(max_positions=100)
    ro = {p: np.full((1, 1), p, np.float32) for p in range(6)}
    store.put("s", SessionValues([1, 2, 3, 4, 5, 6], ro, {3: (2, -0.5, [(7, -0.1), (8, -0.2)])}, computed=6))
    same = store.lookup("s", [1, 2, 3, 4, 5, 6, 7])
    assert sorted(same.readouts) == list(range(6)) and same.computed == 6
    assert same.logprob(3, 1) == (1, -0.5, [(7, -0.1)])
    assert same.logprob(3, 5) is None  # computed with top-2 only
    rewound = store.lookup("s", [1, 2, 3, 9, 9])
    assert sorted(rewound.readouts) == [0, 1, 2] and rewound.logprobs == {} and rewound.computed == 3
    store.release("s")
    assert store.lookup("s", [1, 2, 3]).readouts == {}


def test_store_evicts_least_recently_used_sessions() -> None:
    store = ValueStore(max_positions=10)
    for key in "abc":
        store.put(key, SessionValues([1] * 4, {p: np.zeros((1, 1), np.float32) for p in range(4)}))
    assert len(store) == 2 and store.lookup("a", [1] * 4).readouts == {}


def test_ranges_and_vllm_logprob_dicts() -> None:
    assert ranges([5, 1, 2, 3, 7]) == [[1, 4], [5, 6], [7, 8]]

    class Lp:
        def __init__(self, logprob: float, rank: int) -> None:
            self.logprob, self.rank = logprob, rank

    entry = {9: Lp(-3.0, 4), 1: Lp(-0.5, 1), 2: Lp(-1.0, 2)}
    assert decode_logprob(entry, 9, 2) == (-3.0, [(1, -0.5), (2, -1.0)])
    assert decode_logprob(entry, 9, 0) == (-3.0, None)


VISION = VisionTokens(vision_start=VISION_START, image_pad=IMAGE_PAD, vision_end=VISION_END)


def test_image_runs_collapse_to_one_pad() -> None:
    tokens = [1, 2, *vision_block(4), 3, *vision_block(6), 4]
    images = [ImageSpan.of(2, 8, b"a", "image/png"), ImageSpan.of(9, 17, b"b", "image/png")]
    assert collapse(tokens, images, VISION) == [1, 2, *vision_block(1), 3, *vision_block(1), 4]
    assert collapse([1, 2], [], None) == [1, 2]
    with pytest.raises(GatewayError):
        collapse(tokens, images, None)


@pytest.mark.parametrize(("width", "height"), [(56, 56), (100, 60), (300, 200)])
def test_image_token_count_comes_from_the_models_processor(tmp_path: Path, width: int, height: int) -> None:
    from transformers import Qwen2VLImageProcessorPil

    model = build_tiny_qwen2_vl(tmp_path / "vl")
    data = image_bytes(width, height)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model)
    grid = processor(images=[_pil(data)], return_tensors="np")["image_grid_thw"][0]
    expected = int(np.prod(grid)) // processor.merge_size**2
    assert ImageCounter(model)(data, "image/png") == expected
    assert 4 <= expected <= 16


def _pil(data: bytes) -> object:
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")
