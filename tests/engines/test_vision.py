"""Qwen2-VL through the real core: SessionService + EnginePool + TransformersEngine.

A tiny random Qwen2-VL is built offline for the module. The reference for "correct" is
transformers' own Qwen2-VL path (``input_ids`` + ``pixel_values`` + ``mm_token_type_ids``,
whole sequence, no cache): the engine's chunked prefill, KV reuse across turns and
image-feature placement must reproduce its greedy tokens and logprobs. Everything runs
in float32; agreement is asserted to ``ATOL`` in logprob (measured differences are
around 1e-6: only the order of floating-point sums changes between chunkings).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prismgate.core.actions import GenerateAction, GenerateSpec, ImageInput, PositionRange
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, Event, TokenEvent
from prismgate.core.pool import EnginePool
from prismgate.core.service import SessionService
from prismgate.core.session import ImageSpan
from prismgate.core.stores import InProcessStore
from prismgate.engines.hf.engine import TransformersEngine
from prismgate.engines.hf.vision import Qwen2VLAdapter
from prismgate.engines.readouts.pack import ConceptPack
from tests.vision_model import (
    IM_END,
    IM_START,
    IMAGE_PAD,
    MAX_PIXELS,
    MERGE_SIZE,
    MIN_PIXELS,
    PATCH_SIZE,
    build_tiny_qwen2_vl,
    image_bytes,
    vision_block,
)

ATOL = 1e-4
MODEL = "tiny-qwen2-vl"
PNG = "image/png"


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.fixture(scope="module")
def pack_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    directions = rng.standard_normal((2, 3, 64)).astype(np.float32)
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
    pack = ConceptPack(directions=directions, layers=(0, 1), concepts=("a", "b", "c"), model_id=MODEL)
    path = tmp_path_factory.mktemp("pack") / "pack.safetensors"
    pack.save(path)
    return path


@pytest.fixture(scope="module")
def engine(loop: asyncio.AbstractEventLoop, vl_dir: Path, pack_path: Path) -> Iterator[TransformersEngine]:
    # A small prefill chunk, so that image blocks meet chunk boundaries.
    engine = TransformersEngine(
        vl_dir, model_id=MODEL, concept_pack=pack_path, dtype="float32", threads=1, prefill_chunk=16
    )
    pool = EnginePool([engine])
    loop.run_until_complete(pool.start())
    yield engine
    loop.run_until_complete(pool.close())


@pytest.fixture(scope="module")
def service(engine: TransformersEngine) -> SessionService:
    return SessionService(EnginePool([engine]), InProcessStore())


@pytest.fixture(scope="module")
def reference(engine: TransformersEngine) -> Any:
    return vl(engine).model


# -- helpers ------------------------------------------------------------------------------


def vl(engine: TransformersEngine) -> Qwen2VLAdapter:
    adapter = engine._adapter
    assert isinstance(adapter, Qwen2VLAdapter)
    return adapter


def run(loop: asyncio.AbstractEventLoop, stream: Any) -> tuple[list[TokenEvent], Done]:
    async def collect() -> tuple[list[TokenEvent], Done]:
        events: list[Event] = [e async for e in stream]
        assert isinstance(events[-1], Done)
        return [e for e in events if isinstance(e, TokenEvent)], events[-1]

    return loop.run_until_complete(collect())


def fails(loop: asyncio.AbstractEventLoop, stream: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        run(loop, stream)
    return info.value


class Prompt:
    """Builds an append: text tokens and image blocks, with the ImageInputs placed at their positions."""

    def __init__(self, base: int = 0) -> None:
        self.base = base
        self.tokens: list[int] = []
        self.images: list[ImageInput] = []

    def text(self, *ids: int) -> Prompt:
        self.tokens.extend(ids)
        return self

    def image(self, data: bytes, n: int, mime: str = PNG) -> Prompt:
        start = self.base + len(self.tokens)
        self.tokens.extend(vision_block(n))
        self.images.append(ImageInput(data=data, mime=mime, start=start, end=start + n + 2))
        return self


def action(
    prompt: Prompt, spec: GenerateSpec, *, offset: int | None = None, truncating: bool = False
) -> GenerateAction:
    return GenerateAction(
        append_tokens=tuple(prompt.tokens), images=tuple(prompt.images), offset=offset, truncating=truncating, spec=spec
    )


def greedy(max_tokens: int, *, logprobs_from: int | None = None, **kw: Any) -> GenerateSpec:
    ranges = (PositionRange(logprobs_from, logprobs_from + max_tokens),) if logprobs_from is not None else ()
    return GenerateSpec(max_tokens=max_tokens, ignore_eos=True, logprob_ranges=ranges, logprob_top_k=3, **kw)


def hf_greedy(
    model: Any, processor: Any, tokens: list[int], images: list[ImageSpan], steps: int
) -> list[tuple[int, float]]:
    """Greedy decoding with transformers' own Qwen2-VL path, recomputing the whole sequence each step
    (on the model's device: the engine's own model, on a GPU where there is one)."""
    from PIL import Image

    pixels = processor(images=[Image.open(io.BytesIO(s.data)) for s in images], return_tensors="pt").to(model.device)
    out: list[tuple[int, float]] = []
    seq = list(tokens)
    with torch.inference_mode():
        for _ in range(steps):
            ids = torch.tensor([seq], device=model.device)
            kinds = torch.zeros_like(ids, dtype=torch.int32)
            for s in images:
                kinds[0, s.start + 1 : s.end - 1] = 1
            logits = model(
                input_ids=ids,
                pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=kinds,
                logits_to_keep=1,
            ).logits[0, -1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            token = int(torch.argmax(logp))
            out.append((token, float(logp[token])))
            seq.append(token)
    return out


def readouts(events: list[TokenEvent]) -> np.ndarray:
    """``[positions, layers, concepts]``; every event must carry a readout."""
    rows = [e.readout for e in events]
    assert all(r is not None for r in rows)
    return np.stack([r for r in rows if r is not None])


def spans_of(prompt: Prompt) -> list[ImageSpan]:
    return [ImageSpan.of(im.start, im.end, im.data, im.mime) for im in prompt.images]


def assert_same_run(got: list[TokenEvent], want: list[tuple[int, float]]) -> None:
    decoded = [e for e in got if not e.is_prefill]
    assert [e.id for e in decoded] == [t for t, _ in want]
    for event, (_, logprob) in zip(decoded, want, strict=True):
        assert event.logprob is not None
        assert abs(event.logprob - logprob) < ATOL


def smart_resize_tokens(width: int, height: int) -> int:
    """N for an image, from the family's resize rule, written out independently of the processor."""
    import math

    factor = PATCH_SIZE * MERGE_SIZE
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h, w = (
            max(factor, math.floor(height / beta / factor) * factor),
            max(factor, math.floor(width / beta / factor) * factor),
        )
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor)


# -- image token counts ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "fmt"),
    [(28, 28, "PNG"), (100, 60, "PNG"), (300, 200, "JPEG"), (640, 480, "WEBP"), (57, 913, "PNG"), (33, 90, "GIF")],
)
def test_image_tokens_match_the_processor(engine: TransformersEngine, width: int, height: int, fmt: str) -> None:
    data = image_bytes(width, height, fmt=fmt, seed=width)
    n = engine.image_tokens(data, f"image/{fmt.lower()}")
    processor = vl(engine).images.processor
    from PIL import Image

    grid = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt")["image_grid_thw"][0]
    assert n == int(grid.prod()) // MERGE_SIZE**2
    assert n == smart_resize_tokens(width, height)
    assert 4 <= n <= 16  # the tiny processor's min and max pixels
    assert engine.image_tokens(data, "") == n  # cached by digest; an empty MIME type is sniffed


@pytest.mark.parametrize(
    ("data", "mime", "says"),
    [
        (b"not an image at all", PNG, "could not be decoded"),
        (image_bytes(64, 64)[:60], PNG, "could not be decoded"),
        (b"", PNG, "empty"),
        (image_bytes(64, 64), "application/pdf", "unsupported image type"),
        (image_bytes(64, 64, fmt="TIFF"), "", "unsupported image format TIFF"),
        (image_bytes(1, 300), PNG, "cannot be used"),  # aspect ratio above 200
    ],
)
def test_bad_images_are_invalid_argument(
    loop: asyncio.AbstractEventLoop, service: SessionService, data: bytes, mime: str, says: str
) -> None:
    session = loop.run_until_complete(service.open(MODEL))
    prompt = Prompt().text(IM_START, 65).image(data, 4, mime)
    error = fails(loop, service.generate(session.id, action(prompt, greedy(2), offset=0)))
    assert error.code is Code.INVALID_ARGUMENT
    assert says in error.message
    assert len(loop.run_until_complete(service.session(session.id))) == 0  # nothing was appended


def test_image_size_limits(engine: TransformersEngine) -> None:
    preparer = vl(engine).images
    data = image_bytes(200, 100, seed=5)
    old = (preparer.max_bytes, preparer.max_pixels)
    try:
        preparer.max_bytes = len(data) - 1
        with pytest.raises(GatewayError, match="more than the limit of") as info:
            engine.image_tokens(data, PNG)
        assert info.value.code is Code.INVALID_ARGUMENT
        preparer.max_bytes, preparer.max_pixels = old[0], 200 * 100 - 1
        with pytest.raises(GatewayError, match=r"200x100 pixels, more than the limit"):
            engine.image_tokens(data, PNG)
    finally:
        preparer.max_bytes, preparer.max_pixels = old


# -- generation through the core ------------------------------------------------------------


def test_image_run_generates_and_the_image_matters(
    loop: asyncio.AbstractEventLoop, service: SessionService, engine: TransformersEngine
) -> None:
    first, second = image_bytes(100, 60, seed=1), image_bytes(100, 60, seed=2)
    n = engine.image_tokens(first, PNG)
    assert engine.image_tokens(second, PNG) == n
    results: list[list[float]] = []
    for data in (first, second):
        session = loop.run_until_complete(service.open(MODEL))
        prompt = Prompt().text(IM_START, 117, 10).image(data, n).text(104, 105, IM_END, 10, IM_START, 97, 10)
        events, done = run(
            loop, service.generate(session.id, action(prompt, greedy(6, logprobs_from=len(prompt.tokens)), offset=0))
        )
        assert done.completion_tokens == 6 and done.prompt_tokens == len(prompt.tokens)
        assert [e.position for e in events] == list(range(len(prompt.tokens), len(prompt.tokens) + 6))
        assert len(loop.run_until_complete(service.session(session.id))) == len(prompt.tokens) + 6
        results.append([e.logprob for e in events if e.logprob is not None])
        assert len(results[-1]) == 6
    # same tokens, different pixels: the vision features reach the language model
    assert max(abs(a - b) for a, b in zip(results[0], results[1], strict=True)) > 1e-3


def test_wrong_pad_count_names_the_expected_count(
    loop: asyncio.AbstractEventLoop, service: SessionService, engine: TransformersEngine
) -> None:
    data = image_bytes(300, 200, seed=3)
    n = engine.image_tokens(data, PNG)
    session = loop.run_until_complete(service.open(MODEL))
    error = fails(
        loop, service.generate(session.id, action(Prompt().text(IM_START).image(data, n + 1), greedy(1), offset=0))
    )
    assert error.code is Code.INVALID_ARGUMENT
    assert f"holds {n + 1} image pad tokens but this image becomes {n}" in error.message
    assert len(loop.run_until_complete(service.session(session.id))) == 0


def test_matches_transformers_with_two_images(
    loop: asyncio.AbstractEventLoop, service: SessionService, engine: TransformersEngine, reference: Any
) -> None:
    a, b = image_bytes(112, 112, seed=11), image_bytes(60, 140, seed=12)
    assert engine.image_tokens(a, PNG) == 16  # its block (18 tokens) is longer than a prefill chunk (16)
    prompt = (
        Prompt().text(IM_START, 117, 10).image(a, 16).text(32, 97, 110, 100, 32)
        .image(b, engine.image_tokens(b, PNG)).text(IM_END, 10, IM_START, 97, 10)
    )  # fmt: skip
    # chunks of 16 would end inside both blocks: the first chunk stops before block a, the
    # next one holds all of it (18 tokens), the one after stops before block b
    adapter = engine._adapter
    assert adapter is not None
    spans = spans_of(prompt)
    assert adapter.chunk_end(spans, 0, 16) == 3 and adapter.chunk_end(spans, 3, 19) == 21
    assert adapter.chunk_end(spans, 21, 37) == spans[1].start
    session = loop.run_until_complete(service.open(MODEL))
    events, done = run(
        loop, service.generate(session.id, action(prompt, greedy(8, logprobs_from=len(prompt.tokens)), offset=0))
    )
    processor = vl(engine).images.processor
    assert_same_run(events, hf_greedy(reference, processor, prompt.tokens, spans_of(prompt), 8))
    assert done.prefilled_tokens == len(prompt.tokens)


def test_delta_prefill_equals_recompute(
    loop: asyncio.AbstractEventLoop, service: SessionService, engine: TransformersEngine
) -> None:
    data = image_bytes(90, 90, seed=21)
    n = engine.image_tokens(data, PNG)
    session = loop.run_until_complete(service.open(MODEL))
    turn1 = Prompt().text(IM_START, 117, 10).image(data, n).text(104, IM_END, 10, IM_START, 97, 10)
    run(loop, service.generate(session.id, action(turn1, greedy(4), offset=0)))
    length = len(loop.run_until_complete(service.session(session.id)))
    turn2 = Prompt(length).text(IM_END, 10, IM_START, 117, 10, 119, 104, 121, IM_END, 10, IM_START, 97, 10)
    events, done2 = run(
        loop,
        service.generate(session.id, action(turn2, greedy(6, logprobs_from=length + len(turn2.tokens)), offset=length)),
    )
    # only the new turn (and the last decoded token of turn 1) ran through the model
    assert done2.cached_tokens == length - 1
    assert done2.prefilled_tokens == len(turn2.tokens) + 1
    # a full recompute of the same timeline, images re-declared, in a throwaway session
    timeline = loop.run_until_complete(service.dump(session.id))[: length + len(turn2.tokens)]
    whole = Prompt().text(*timeline)
    whole.images = list(turn1.images)
    recomputed, done3 = run(loop, service.run(action(whole, greedy(6, logprobs_from=len(timeline))), model=MODEL))
    assert done3.cached_tokens == 0
    assert [e.id for e in events] == [e.id for e in recomputed]
    for got, want in zip(events, recomputed, strict=True):
        assert got.logprob is not None and want.logprob is not None
        assert abs(got.logprob - want.logprob) < ATOL
        assert got.top_logprobs is not None and want.top_logprobs is not None
        assert [i for i, _ in got.top_logprobs] == [i for i, _ in want.top_logprobs]


def test_replacing_an_image_of_the_same_size_recomputes_it(
    loop: asyncio.AbstractEventLoop, service: SessionService, engine: TransformersEngine, reference: Any
) -> None:
    """Same token ids, other pixels: the cached keys/values of the old image must not be reused."""
    old, new = image_bytes(100, 60, seed=31), image_bytes(100, 60, seed=32)
    n = engine.image_tokens(old, PNG)
    session = loop.run_until_complete(service.open(MODEL))
    head = Prompt().text(IM_START, 117, 10)
    run(loop, service.generate(session.id, action(head, greedy(0), offset=0)))
    tail = [IM_END, 10, IM_START, 97, 10]
    run(loop, service.generate(session.id, action(Prompt(3).image(old, n).text(*tail), greedy(3), offset=3)))
    # rewind to the image's start and put the other image there: identical token ids
    swapped = Prompt(3).image(new, n).text(*tail)
    events, done = run(
        loop,
        service.generate(
            session.id, action(swapped, greedy(5, logprobs_from=3 + len(swapped.tokens)), offset=3, truncating=True)
        ),
    )
    assert done.cached_tokens <= 3  # restarted at (or before) the image, not after it
    prompt = head.tokens + swapped.tokens
    processor = vl(engine).images.processor
    assert_same_run(events, hf_greedy(reference, processor, prompt, spans_of(swapped), 5))


def test_truncating_rewind_to_an_image_boundary(
    loop: asyncio.AbstractEventLoop, service: SessionService, engine: TransformersEngine, reference: Any
) -> None:
    a, b, c = image_bytes(56, 56, seed=41), image_bytes(120, 60, seed=42), image_bytes(30, 200, seed=43)
    session = loop.run_until_complete(service.open(MODEL))
    turn1 = Prompt().text(IM_START, 117, 10).image(a, engine.image_tokens(a, PNG)).text(104, 105, 10)
    run(loop, service.generate(session.id, action(turn1, greedy(0), offset=0)))
    base = len(turn1.tokens)
    turn2 = Prompt(base).image(b, engine.image_tokens(b, PNG)).text(IM_END, 10, IM_START, 97, 10)
    run(loop, service.generate(session.id, action(turn2, greedy(3), offset=base)))
    inside = turn2.images[0].start + 2
    error = fails(loop, service.generate(session.id, action(Prompt(inside), greedy(1), offset=inside, truncating=True)))
    assert error.code is Code.FAILED_PRECONDITION
    assert f"[{turn2.images[0].start}, {turn2.images[0].end})" in error.message
    # rewind to the second image's first position (a block boundary) and put another image there
    turn3 = Prompt(base).image(c, engine.image_tokens(c, PNG)).text(IM_END, 10, IM_START, 97, 10)
    events, done = run(
        loop,
        service.generate(
            session.id, action(turn3, greedy(4, logprobs_from=base + len(turn3.tokens)), offset=base, truncating=True)
        ),
    )
    stored = loop.run_until_complete(service.session(session.id))
    assert [im.digest for im in stored.images] == [s.digest for s in spans_of(turn1) + spans_of(turn3)]
    assert done.cached_tokens == base  # the first image's turn was reused
    processor = vl(engine).images.processor
    want = hf_greedy(reference, processor, turn1.tokens + turn3.tokens, spans_of(turn1) + spans_of(turn3), 4)
    assert_same_run(events, want)


def test_fork_inside_an_image_block_is_refused(
    loop: asyncio.AbstractEventLoop, service: SessionService, engine: TransformersEngine
) -> None:
    data = image_bytes(100, 100, seed=51)
    n = engine.image_tokens(data, PNG)
    session = loop.run_until_complete(service.open(MODEL))
    prompt = Prompt().text(IM_START, 117, 10).image(data, n).text(104, 105)
    run(loop, service.generate(session.id, action(prompt, greedy(2), offset=0)))
    image = prompt.images[0]
    for position in (image.start + 1, image.start + 1 + n // 2, image.end - 1):
        with pytest.raises(GatewayError) as info:
            loop.run_until_complete(service.fork(session.id, position))
        assert info.value.code is Code.FAILED_PRECONDITION
        assert "inside the image block" in info.value.message
    child = loop.run_until_complete(
        service.fork(session.id, image.end)
    )  # a block boundary is fine, and keeps the image
    assert [im.digest for im in child.images] == [
        im.digest for im in loop.run_until_complete(service.session(session.id)).images
    ]
    events, done = run(
        loop, service.generate(child.id, action(Prompt(image.end).text(IM_END), greedy(3), offset=image.end))
    )
    assert done.completion_tokens == 3 and len(events) == 3
    before = loop.run_until_complete(service.fork(session.id, image.start))
    assert before.images == [] and len(before) == image.start


def test_readouts_for_an_image_session(
    loop: asyncio.AbstractEventLoop,
    service: SessionService,
    engine: TransformersEngine,
    reference: Any,
    pack_path: Path,
) -> None:
    data = image_bytes(80, 120, seed=61)
    n = engine.image_tokens(data, PNG)
    prompt = Prompt().text(IM_START, 117, 10).image(data, n).text(104, 105, 10)
    session = loop.run_until_complete(service.open(MODEL))
    spec = GenerateSpec(max_tokens=2, ignore_eos=True, readout_ranges=(PositionRange(0, len(prompt.tokens) + 2),))
    events, _ = run(loop, service.generate(session.id, action(prompt, spec, offset=0)))
    assert [e.position for e in events] == list(range(len(prompt.tokens) + 2))
    got = readouts(events[: len(prompt.tokens)])
    assert got.shape == (len(prompt.tokens), 2, 3)
    # layer 0's residual stream, from transformers' own path
    from PIL import Image

    processor = vl(engine).images.processor
    pixels = processor(images=[Image.open(io.BytesIO(data))], return_tensors="pt").to(reference.device)
    ids = torch.tensor([prompt.tokens], device=reference.device)
    with torch.inference_mode():
        out = reference(
            input_ids=ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == IMAGE_PAD).int(),
            output_hidden_states=True,
        )
    directions = ConceptPack.load(pack_path).directions
    want = out.hidden_states[1][0].float().cpu().numpy() @ directions[0].T
    np.testing.assert_allclose(got[:, 0, :], want, atol=1e-4)
    # the readouts of the next turn's reused prefix equal those computed the first time
    length = len(loop.run_until_complete(service.session(session.id)))
    spec2 = GenerateSpec(max_tokens=1, ignore_eos=True, readout_ranges=(PositionRange(0, length),))
    again, _ = run(loop, service.generate(session.id, action(Prompt(length).text(IM_END), spec2, offset=length)))
    np.testing.assert_allclose(readouts(again[: len(prompt.tokens)]), got, atol=1e-4)


# -- a text-only model ---------------------------------------------------------------------------


def test_text_only_model_refuses_images(loop: asyncio.AbstractEventLoop, tiny_model_dir: Path) -> None:
    engine = TransformersEngine(tiny_model_dir, model_id="tiny-llama", dtype="float32", threads=1)
    pool = EnginePool([engine])
    loop.run_until_complete(pool.start())
    try:
        assert engine.info.vision is None
        service = SessionService(pool, InProcessStore())
        session = loop.run_until_complete(service.open("tiny-llama"))
        prompt = Prompt().text(IM_START, 65).image(image_bytes(56, 56), 4)
        error = fails(loop, service.generate(session.id, action(prompt, greedy(1), offset=0)))
        assert error.code is Code.INVALID_ARGUMENT
        assert "takes no images" in error.message
        with pytest.raises(GatewayError, match="takes no images"):
            engine.image_tokens(image_bytes(56, 56), PNG)
    finally:
        loop.run_until_complete(pool.close())


# -- the adapter's boundaries ----------------------------------------------------------------------


def test_chunks_and_restarts_never_split_an_image(engine: TransformersEngine) -> None:
    adapter = engine._adapter
    assert adapter is not None
    spans = [ImageSpan.of(3, 13, b"a", PNG), ImageSpan.of(20, 30, b"b", PNG)]
    assert adapter.chunk_end(spans, 0, 5) == 3  # moved back to the block's start
    assert adapter.chunk_end(spans, 3, 8) == 13  # a chunk that starts at a block holds all of it
    assert adapter.chunk_end(spans, 13, 16) == 16
    assert adapter.chunk_end(spans, 13, 25) == 20
    assert adapter.chunk_end(spans, 0, 30) == 30
    tokens = list(range(40))
    for start, want in ((0, 0), (3, 3), (4, 3), (12, 3), (13, 13), (25, 20), (30, 30)):
        assert adapter.rewind_point(tokens, spans, start) == want
