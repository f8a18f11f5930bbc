"""Images for the vLLM engine (the Qwen2-VL family).

The gateway's timeline holds each image as a pre-expanded run
``<|vision_start|> + N*<|image_pad|> + <|vision_end|>`` (N from the model's own image
processor, checked by the core). vLLM expands every ``<|image_pad|>`` it is given into the
image's N pads itself, so a pre-expanded run would be expanded again and corrupted: each
run is collapsed to a single pad before the tokens go to vLLM. vLLM re-expands it to the
same N, so positions inside vLLM (hook rows, ``num_cached_tokens``, prompt token ids) are
again the gateway's positions; the engine checks that the lengths agree.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prismgate.core.errors import invalid
from prismgate.core.session import ImageSpan
from prismgate.engines.base import VisionTokens

VISION_MODEL_TYPES = {"qwen2_vl", "qwen2_5_vl"}


def vision_tokens(config: dict[str, Any], tokenizer: Any) -> VisionTokens | None:
    """The framing tokens of a Qwen2-VL-family model, or None for a text model."""
    if config.get("model_type") not in VISION_MODEL_TYPES:
        return None

    def token(field: str, text: str) -> int:
        value = config.get(field)
        return int(value) if value is not None else int(tokenizer.convert_tokens_to_ids(text))

    return VisionTokens(
        vision_start=token("vision_start_token_id", "<|vision_start|>"),
        image_pad=token("image_token_id", "<|image_pad|>"),
        vision_end=token("vision_end_token_id", "<|vision_end|>"),
    )


def collapse(tokens: Sequence[int], images: Sequence[ImageSpan], vision: VisionTokens | None) -> list[int]:
    """``tokens`` with every image run reduced to start + one pad + end, as vLLM expects."""
    if not images:
        return list(tokens)
    if vision is None:
        raise invalid("this model takes no images (it has no vision encoder)")
    out: list[int] = []
    cursor = 0
    for span in sorted(images, key=lambda s: s.start):
        run = tokens[span.start : span.end]
        if len(run) < 3 or run[0] != vision.vision_start or run[-1] != vision.vision_end:
            raise invalid(f"image at [{span.start}, {span.end}) is not a vision block")
        out.extend(tokens[cursor : span.start])
        out.extend((vision.vision_start, vision.image_pad, vision.vision_end))
        cursor = span.end
    out.extend(tokens[cursor:])
    return out


def decode_image(data: bytes, mime: str) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as exc:
        raise invalid(f"cannot decode the {mime or 'image'} bytes: {exc}") from exc
    return image.convert("RGB")


class ImageCounter:
    """Image -> number of pad tokens, from the model's own preprocessor configuration.

    Qwen2-VL resizes each image to ``smart_resize(h, w, factor=patch*merge, min_pixels,
    max_pixels)`` and emits one token per ``(patch*merge)^2`` pixel cell. The Hugging Face
    image processor is asked first; when it cannot load (its fast variant needs
    torchvision, which cannot be installed beside the CPU torch), the same arithmetic is
    done here from ``preprocessor_config.json``.
    """

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self._processor: Any = None
        self._config: dict[str, Any] | None = None

    def __call__(self, data: bytes, mime: str) -> int:
        image = decode_image(data, mime)
        processor = self._hf_processor()
        if processor is not None:
            out = processor(images=[image], return_tensors="np")
            grid = out["image_grid_thw"][0]
            merge = int(getattr(processor, "merge_size", 2))
            return int(math.prod(int(x) for x in grid)) // (merge * merge)
        cfg = self._preprocessor_config()
        patch = int(cfg.get("patch_size", 14))
        merge = int(cfg.get("merge_size", 2))
        size = cfg.get("size") or {}
        min_pixels = int(cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        max_pixels = int(cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        h, w = smart_resize(image.height, image.width, patch * merge, min_pixels, max_pixels)
        return (h // (patch * merge)) * (w // (patch * merge))

    def _hf_processor(self) -> Any:
        if self._processor is None:
            try:
                from transformers import AutoImageProcessor

                self._processor = AutoImageProcessor.from_pretrained(self.model_path, use_fast=False)
            except Exception:
                self._processor = False
        return self._processor or None

    def _preprocessor_config(self) -> dict[str, Any]:
        if self._config is None:
            path = self.model_path / "preprocessor_config.json"
            self._config = json.loads(path.read_text()) if path.exists() else {}
        return self._config


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of ``factor``, area within the pixel bounds."""
    if min(height, width) <= 0:
        raise invalid(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > 200:
        raise invalid(f"image aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w
