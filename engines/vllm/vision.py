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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prismgate.core.engine import VisionTokens
from prismgate.core.errors import invalid
from prismgate.core.session import ImageSpan

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
    """Image -> number of pad tokens, from the model's own image processor.

    The same preparation the transformers engine uses (``ImagePreparer`` around
    ``Qwen2VLImageProcessorPil``: PIL only, since torchvision cannot be installed beside
    the CPU torch), so both engines accept the same images with the same errors and agree
    on N = prod(image_grid_thw) / merge_size^2.
    """

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self._preparer: Any = None

    def __call__(self, data: bytes, mime: str) -> int:
        if self._preparer is None:
            from transformers import Qwen2VLImageProcessorPil

            from prismgate.engines.hf.vision import ImagePreparer

            self._preparer = ImagePreparer(Qwen2VLImageProcessorPil.from_pretrained(self.model_path))
        return int(self._preparer.get(data, mime).n_tokens)
