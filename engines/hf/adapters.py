"""What differs between model families inside the transformers engine.

A text model needs nothing but token ids. A vision model (the Qwen2-VL family) also
needs pixel values for the images inside the chunk being run, 3-D rotary positions
for the whole timeline, and chunks that never split an image block.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from prismgate.core.engine import VisionTokens
from prismgate.core.errors import invalid
from prismgate.core.session import ImageSpan
from prismgate.engines.hf.cpu_dtype import DtypeChoice, choose_dtype


class ModelAdapter:
    """A causal language model that takes only token ids."""

    vision_tokens: VisionTokens | None = None
    dtype_choice: DtypeChoice | None = None  # set by load_adapter: the dtype it loaded in, and why

    def __init__(self, model: Any, tokenizer: Any, device: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device

    def new_cache(self) -> Any:
        from prismgate.engines.hf import kv_room

        return kv_room.new_cache(self.model.config)

    def rewind_point(self, tokens: Sequence[int], images: Sequence[ImageSpan], start: int, cache: Any = None) -> int:
        """The position to restart from, at or before ``start``.

        ``cache`` is the session's cached KV state (None when there is none); its token ids
        match ``tokens`` up to ``start``, but a vision model must also check that it encoded
        the same images there (two images of one size give the same token ids).
        """
        return start

    def chunk_end(self, images: Sequence[ImageSpan], start: int, end: int) -> int:
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
        """Run ``ids`` (positions ``start``...) and return logits for ``rows``, in the model's dtype.

        Not converted to float32 here: a scored prefill chunk keeps up to 512 rows of the whole
        vocabulary (50 MB in bf16 at SmolLM2's 49k, 100 MB more as float32); callers convert the
        rows they use, one at a time (the same bits as converting all of them).
        """
        check_cache(cache, start)
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=torch.tensor(list(rows), dtype=torch.long, device=self.device),
            **self.extra_inputs(ids, start, timeline, images),
        )
        return out.logits[0]

    def extra_inputs(
        self, ids: Sequence[int], start: int, timeline: Sequence[int], images: Sequence[ImageSpan]
    ) -> dict[str, Any]:
        return {}

    # Several sequences' decode steps in one forward pass. Each sequence keeps its own
    # cache (sessions keep theirs between turns); the engine merges the caches of those
    # decoding together into one, left-padded to the longest, and keeps that merge while they
    # stay together (:mod:`~prismgate.engines.hf.batch_cache`).
    batches_decode = True

    def decode_batch(self, ids: Sequence[int], caches: Sequence[Any], positions: Sequence[int]) -> torch.Tensor:
        """Feed ``ids[j]`` at ``positions[j]`` to ``caches[j]`` (which hold ``positions[j]`` tokens), once.

        Returns float32 logits ``[batch, vocab]``; every cache comes back one token longer.
        The engine keeps the merge across steps instead (:class:`~prismgate.engines.hf.batch_cache.BatchCache`).
        """
        from prismgate.engines.hf.batch_cache import BatchCache

        batch = BatchCache(self)
        logits = batch.step(ids, caches, positions)
        batch.leave_all()
        return logits

    def forward_batch(self, ids: Sequence[int], merged: Any, positions: Sequence[int], width: int) -> torch.Tensor:
        """A decode step on a merged cache: row ``j`` holds ``positions[j]`` tokens in its last ``width`` columns."""
        out = self.model(
            input_ids=torch.tensor([[t] for t in ids], dtype=torch.long, device=self.device),
            attention_mask=padding_mask(positions, width, self.device),
            position_ids=torch.tensor([[p] for p in positions], dtype=torch.long, device=self.device),
            cache_position=torch.tensor([width], dtype=torch.long, device=self.device),
            past_key_values=merged,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].to(torch.float32)

    def image_tokens(self, data: bytes, mime: str) -> int:
        raise invalid("this model takes no images (it has no vision encoder)")


def padding_mask(positions: Sequence[int], width: int, device: str) -> torch.Tensor:
    """The 2-D attention mask of a decode step over a merged cache ``width`` columns wide: row ``j``
    sees its last ``positions[j]`` columns (the rest is left padding) and the token it feeds."""
    mask = torch.zeros((len(positions), width + 1), dtype=torch.long, device=device)
    for row, position in enumerate(positions):
        mask[row, width - position :] = 1
    return mask


def check_cache(cache: Any, start: int) -> None:
    """The engine's bookkeeping and the KV cache must agree on where the timeline resumes."""
    if cache.get_seq_length() != start:
        raise RuntimeError(f"KV cache holds {cache.get_seq_length()} tokens, expected {start}")


def load_adapter(path: Path, *, device: str, dtype: str, flags: frozenset[str] | None = None) -> ModelAdapter:
    """The model in ``path`` on ``device``. ``dtype`` "auto" follows the CPU rule of
    :mod:`~prismgate.engines.hf.cpu_dtype` when the CPU's ``flags`` are given (serving), and keeps
    the weights' dtype when not (the instruments: an artifact is the same on every CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((path / "config.json").read_text())
    choice = choose_dtype(dtype, config.get("dtype") or config.get("torch_dtype"), device, flags)
    torch_dtype = choice.dtype
    if config.get("model_type") in {"qwen2_vl", "qwen2_5_vl"}:
        from prismgate.engines.hf.vision import Qwen2VLAdapter

        adapter: ModelAdapter = Qwen2VLAdapter.load(path, device=device, dtype=torch_dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        model.to(device)  # type: ignore[arg-type]
        model.eval()
        adapter = ModelAdapter(model, tokenizer, device)
    adapter.dtype_choice = choice
    return adapter
