"""Qwen2-VL family support for the transformers engine.

A session's timeline holds each image as a pre-expanded block ``vision_start + N * image_pad +
vision_end``. Running it needs what a text model does not: the vision tower's features written
over the pads (by declared position, never by token id), 3-D rotary positions (M-RoPE) computed
once per timeline with the model's own ``get_rope_index``, chunk and restart points outside image
blocks, and a KV cache that knows which images it encoded (two images of one size give the same
ids). Images are preprocessed without torchvision and cached by digest. Why each:
docs/architecture.md, "Vision models".
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prismgate.core.engine import VisionTokens
from prismgate.core.errors import invalid
from prismgate.core.session import ImageSpan
from prismgate.engines.hf.adapters import ModelAdapter, check_cache

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # encoded size of one image
MAX_IMAGE_PIXELS = 50_000_000  # decoded width * height, checked before decoding (decompression bombs)
PIXEL_CACHE_BYTES = 256 * 1024 * 1024  # preprocessed pixel values kept between validation and prefill
LAYOUT_CACHE_ENTRIES = 64

# Formats PIL decodes here that the family is used with; the bytes decide, not the MIME type.
SUPPORTED_FORMATS = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
}
SUPPORTED_MIMES = set(SUPPORTED_FORMATS.values()) | {"image/jpg", "image/x-ms-bmp"}

_MODEL_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
_SPECIAL = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """An image as the vision tower takes it."""

    pixel_values: torch.Tensor  # float32 [patches, channels * temporal_patch * patch * patch]
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    n_tokens: int  # image pad tokens it becomes: prod(grid_thw) / merge_size**2

    @property
    def nbytes(self) -> int:
        return int(self.pixel_values.numel() * self.pixel_values.element_size())


class ImagePreparer:
    """Bytes -> :class:`PreparedImage`, with checks and an LRU cache by digest (thread-safe)."""

    def __init__(
        self,
        processor: Any,
        *,
        max_bytes: int = MAX_IMAGE_BYTES,
        max_pixels: int = MAX_IMAGE_PIXELS,
        cache_bytes: int = PIXEL_CACHE_BYTES,
    ) -> None:
        self.processor = processor
        self.merge_size = int(processor.merge_size)
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, PreparedImage] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, data: bytes, mime: str, digest: str | None = None) -> PreparedImage:
        key = digest or hashlib.sha256(data).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        prepared = self._prepare(data, mime)
        with self._lock:
            if key not in self._cache and prepared.nbytes <= self.cache_bytes:
                self._cache[key] = prepared
                self._held += prepared.nbytes
                while self._held > self.cache_bytes:
                    _, dropped = self._cache.popitem(last=False)
                    self._held -= dropped.nbytes
        return prepared

    def _prepare(self, data: bytes, mime: str) -> PreparedImage:
        from PIL import Image, UnidentifiedImageError

        mime = (mime or "").strip().lower()
        if mime and mime not in SUPPORTED_MIMES:
            raise invalid(
                f"unsupported image type {mime!r}; send one of {', '.join(sorted(SUPPORTED_FORMATS.values()))}"
            )
        if not data:
            raise invalid("the image is empty (0 bytes)")
        if len(data) > self.max_bytes:
            raise invalid(f"the image is {len(data)} bytes, more than the limit of {self.max_bytes}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
                fmt = image.format or "?"
                if fmt not in SUPPORTED_FORMATS:
                    raise invalid(
                        f"unsupported image format {fmt}; send one of {', '.join(sorted(SUPPORTED_FORMATS.values()))}"
                    )
                width, height = image.size
                if width * height > self.max_pixels:
                    raise invalid(
                        f"the image is {width}x{height} pixels, more than the limit of {self.max_pixels} pixels"
                    )
                image.load()
        except (
            UnidentifiedImageError,
            OSError,
            SyntaxError,
            ValueError,
            Image.DecompressionBombWarning,
            Image.DecompressionBombError,
        ) as exc:
            label = f" (declared {mime})" if mime else ""
            raise invalid(f"the image bytes{label} could not be decoded: {exc}") from exc
        if min(width, height) < 1:
            raise invalid(f"the image is {width}x{height} pixels; it has no area")
        picture = image if image.mode in ("RGB", "RGBA", "L", "LA", "P") else image.convert("RGB")
        try:
            out = self.processor(images=[picture], return_tensors="pt")
        except ValueError as exc:  # e.g. an aspect ratio above 200
            raise invalid(f"the image ({width}x{height}) cannot be used: {exc}") from exc
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        t, h, w = grid
        return PreparedImage(
            pixel_values=out["pixel_values"].to(torch.float32).contiguous(),
            grid_thw=(t, h, w),
            n_tokens=(t * h * w) // (self.merge_size**2),
        )


def _image_key(span: ImageSpan) -> tuple[int, int, str]:
    return (span.start, span.end, span.digest)


def _outside_blocks(images: Sequence[ImageSpan], position: int) -> int:
    """``position``, moved back to the start of the image block it falls inside, if any."""
    for span in images:
        if span.splits_at(position):
            return span.start
    return position


class Qwen2VLAdapter(ModelAdapter):
    """Qwen2-VL / Qwen2.5-VL: token ids plus images placed as pre-expanded blocks."""

    batches_decode = False  # 3-D rotary positions per sequence: decode steps run one at a time

    def __init__(self, model: Any, tokenizer: Any, processor: Any, device: str) -> None:
        super().__init__(model, tokenizer, device)
        self.images = ImagePreparer(processor)
        self.vision_tokens = _vision_tokens(model, tokenizer)
        self._check_processor(processor)
        # which images (start, end, digest) each live KV cache holds the encoding of
        self._encoded: weakref.WeakKeyDictionary[Any, list[tuple[int, int, str]]] = weakref.WeakKeyDictionary()
        self._layouts: OrderedDict[tuple[tuple[int, int, str], ...], tuple[torch.Tensor, int]] = OrderedDict()

    @classmethod
    def load(cls, path: Path, *, device: str, dtype: torch.dtype) -> Qwen2VLAdapter:
        import transformers
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        path = Path(path)
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        if model_type not in _MODEL_CLASSES:
            raise invalid(f"{path}: model type {model_type!r} is not a Qwen2-VL family model")
        if not (path / "preprocessor_config.json").exists():
            raise invalid(f"{path}: a vision model folder needs its preprocessor_config.json (the image processor)")
        model_class = getattr(transformers, _MODEL_CLASSES[model_type])
        model = model_class.from_pretrained(path, dtype=dtype).to(device)
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        return cls(model, tokenizer, processor, device)

    def _check_processor(self, processor: Any) -> None:
        vision = self.model.config.vision_config
        ours = (int(processor.patch_size), int(processor.merge_size), int(processor.temporal_patch_size))
        theirs = (int(vision.patch_size), int(vision.spatial_merge_size), int(vision.temporal_patch_size))
        if ours != theirs:
            raise invalid(
                f"the image processor's (patch, merge, temporal patch) sizes {ours} do not match "
                f"the vision tower's {theirs}"
            )

    # -- images -----------------------------------------------------------------------

    def image_tokens(self, data: bytes, mime: str) -> int:
        return self.images.get(data, mime).n_tokens

    def _features(self, spans: Sequence[ImageSpan], dtype: torch.dtype) -> list[torch.Tensor]:
        """The vision tower's output for each span, ``[N_i, hidden]``, in one batched call."""
        prepared = [self.images.get(s.data, s.mime, s.digest) for s in spans]
        for span, image in zip(spans, prepared, strict=True):
            if image.n_tokens != span.end - span.start - 2:
                raise RuntimeError(
                    f"image at [{span.start}, {span.end}) holds {span.end - span.start - 2} pads, "
                    f"its pixels make {image.n_tokens}"
                )
        visual = self.model.model.visual
        pixels = torch.cat([p.pixel_values for p in prepared]).to(device=self.device, dtype=visual.dtype)
        grid = torch.tensor([p.grid_thw for p in prepared], dtype=torch.long, device=self.device)
        out = self.model.model.get_image_features(pixels, grid, return_dict=True)
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out[1]
        return [f.to(dtype) for f in pooled]

    # -- positions ----------------------------------------------------------------------

    def _layout(self, images: Sequence[ImageSpan]) -> tuple[torch.Tensor, int]:
        """3-D positions ``[3, last_image_end]`` and the offset ``delta`` for every later position."""
        images = sorted(images, key=lambda s: s.start)
        key = tuple(_image_key(s) for s in images)
        hit = self._layouts.get(key)
        if hit is not None:
            self._layouts.move_to_end(key)
            return hit
        if not images:
            layout: tuple[torch.Tensor, int] = (torch.zeros(3, 0, dtype=torch.long, device=self.device), 0)
        else:
            length = images[-1].end
            kinds = torch.zeros(1, length, dtype=torch.int32, device=self.device)
            for span in images:
                kinds[0, span.start + 1 : span.end - 1] = 1
            grid = torch.tensor(
                [self.images.get(s.data, s.mime, s.digest).grid_thw for s in images],
                dtype=torch.long,
                device=self.device,
            )
            ids = torch.zeros(1, length, dtype=torch.long, device=self.device)
            positions, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid)
            base = positions[:, 0, :]
            layout = (base, int(base.max().item()) + 1 - length)
        self._layouts[key] = layout
        while len(self._layouts) > LAYOUT_CACHE_ENTRIES:
            self._layouts.popitem(last=False)
        return layout

    def positions(self, images: Sequence[ImageSpan], start: int, end: int) -> torch.Tensor:
        """M-RoPE position ids ``[3, 1, end - start]`` for timeline positions ``[start, end)``."""
        base, delta = self._layout(images)
        mapped = base.shape[1]
        head = base[:, start : min(end, mapped)]
        tail_start = min(max(start, mapped), end)
        tail = torch.arange(tail_start + delta, end + delta, dtype=torch.long, device=self.device)
        return torch.cat([head, tail.view(1, -1).expand(3, -1)], dim=1).unsqueeze(1)

    # -- the adapter hooks ----------------------------------------------------------------

    def rewind_point(self, tokens: Sequence[int], images: Sequence[ImageSpan], start: int, cache: Any = None) -> int:
        start = _outside_blocks(images, start)
        if cache is not None:
            held = cache.get_seq_length()
            encoded = {r for r in self._encoded.get(cache, []) if r[1] <= held}
            wanted = {_image_key(s) for s in images}
            for record in encoded:  # encoded there, but that position holds no such image now
                if record[0] < start and record not in wanted:
                    start = record[0]
            for key in wanted:  # an image the cache never encoded (same tokens, other pixels)
                if key[0] < start and key not in encoded:
                    start = key[0]
        return _outside_blocks(images, start)

    def chunk_end(self, images: Sequence[ImageSpan], start: int, end: int) -> int:
        for span in images:
            if span.splits_at(end):
                return span.start if span.start > start else span.end
        return end

    def forward(
        self,
        ids: Sequence[int],
        cache: Any,
        start: int,
        timeline: Sequence[int],
        images: Sequence[ImageSpan],
        rows: Sequence[int],
    ) -> torch.Tensor:
        check_cache(cache, start)
        end = start + len(ids)
        inside = []
        for span in images:
            if span.start < end and span.end > start:  # overlaps the chunk: must lie wholly inside it
                if not (start <= span.start and span.end <= end):
                    raise RuntimeError(f"positions [{start}, {end}) split the image block [{span.start}, {span.end})")
                inside.append(span)
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        embeds = self.model.get_input_embeddings()(input_ids)
        if inside:
            embeds = embeds.clone()
            for span, features in zip(inside, self._features(inside, embeds.dtype), strict=True):
                embeds[0, span.start + 1 - start : span.end - 1 - start] = features
        out = self.model(
            inputs_embeds=embeds,
            position_ids=self.positions(images, start, end),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=torch.tensor(list(rows), dtype=torch.long, device=self.device),
        )
        kept = [r for r in self._encoded.get(cache, []) if r[1] <= start]
        self._encoded[cache] = kept + [_image_key(s) for s in inside]
        return out.logits[0]  # the model's dtype, as ModelAdapter.forward


def _vision_tokens(model: Any, tokenizer: Any) -> VisionTokens:
    """The vision block's special tokens: the tokenizer's, which must be the ones the model uses."""
    ids = []
    for text in _SPECIAL:
        tid = tokenizer.convert_tokens_to_ids(text)
        if tid is None or tid == tokenizer.unk_token_id:
            raise invalid(f"the tokenizer has no {text} token, which a Qwen2-VL model needs")
        ids.append(int(tid))
    tokens = VisionTokens(vision_start=ids[0], image_pad=ids[1], vision_end=ids[2])
    config = model.config
    expected = (
        getattr(config, "vision_start_token_id", tokens.vision_start),
        getattr(config, "image_token_id", tokens.image_pad),
        getattr(config, "vision_end_token_id", tokens.vision_end),
    )
    if (tokens.vision_start, tokens.image_pad, tokens.vision_end) != tuple(int(x) for x in expected):
        raise invalid(f"the tokenizer's vision tokens {ids} differ from the model config's {list(expected)}")
    return tokens
