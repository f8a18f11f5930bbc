"""A tiny random Qwen2-VL, built offline at test time, for tests that need a vision model.

Random weights produce meaningless text, so tests assert on ids, counts, shapes and on
agreement between two ways of computing the same thing, never on words. The sizes are
chosen so that a build takes well under a second on a shared 2-core CPU:

* text model: 2 layers, hidden 64, 2 heads of head_dim 32 (vLLM's CPU attention accepts
  32), mrope sections [4, 6, 6] (they must sum to head_dim / 2);
* vision tower: 1 block, embed dim 32, patch 14, spatial merge 2 (so one image token covers
  a 28x28 pixel cell), temporal patch 2, as in the real family;
* image processor: min 56x56 and max 28*28*16 pixels, so an image becomes 4 to 16 tokens;
* tokenizer: byte-level BPE with no merges (256 byte symbols) plus the Qwen special tokens
  and a ChatML chat template.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

# Token ids of the tiny tokenizer: the 256 byte symbols come first.
ENDOFTEXT = 256
IM_START = 257
IM_END = 258
VISION_START = 259
VISION_END = 260
IMAGE_PAD = 261
VIDEO_PAD = 262
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
VOCAB_SIZE = 320  # 263 real tokens, padded like real checkpoints pad their embedding tables

MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 16
PATCH_SIZE = 14
MERGE_SIZE = 2

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(folder: Path) -> None:
    """Save a byte-level tokenizer with the Qwen2-VL special tokens into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    byte_symbols = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(folder)


def _byte_of(symbol: str) -> int:
    """The byte a ByteLevel alphabet symbol stands for (GPT-2's printable byte mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    code = ord(symbol)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def build_tiny_qwen2_vl(folder: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random Qwen2-VL (weights, tokenizer, image processor) into ``folder``."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": IM_END,
            "pad_token_id": ENDOFTEXT,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,  # the merger's output: the text model's hidden size
            "mlp_ratio": 2,
            "num_heads": 2,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": 2,
        },
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)  # float32, the default
    model.eval()
    model.generation_config.eos_token_id = IM_END
    model.generation_config.pad_token_id = ENDOFTEXT
    model.save_pretrained(folder)
    build_tokenizer(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": True,
                "do_convert_rgb": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "min_pixels": MIN_PIXELS,
                "max_pixels": MAX_PIXELS,
                "patch_size": PATCH_SIZE,
                "merge_size": MERGE_SIZE,
                "temporal_patch_size": 2,
                "resample": 3,
            },
            indent=2,
        )
    )
    return folder


def image_bytes(width: int, height: int, *, fmt: str = "PNG", seed: int = 0) -> bytes:
    """A deterministic noisy RGB image of the given size, encoded as ``fmt``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()


def vision_block(n_pads: int) -> list[int]:
    """The placeholder run a client writes for an image of ``n_pads`` tokens."""
    return [VISION_START] + [IMAGE_PAD] * n_pads + [VISION_END]
