"""Capture the residual stream after chosen decoder layers while prompts run through the model.

What a build reads is what the server reads: forward hooks on the same decoder layers the
serving probe hooks, on the model the engine's own loader loads (:func:`load_model`). Every
token but the first and other massive-norm ones counts (:func:`token_keep`), prompts are raw
text, and the run is deterministic (:func:`deterministic_torch`, sorted right-padded batches,
float64 sums). Why each choice: docs/instruments.md, "What a build reads".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from prismgate.core.errors import invalid
from prismgate.engines.introspect import decoder_layers, hidden_size
from prismgate.instruments.packs.prompt_sets import PromptSet

SKIP_FIRST = 1  # tokens left out at the start of each prompt (the attention sink)
OUTLIER_FACTOR = 3.0  # tokens above this multiple of their prompt's median norm are left out
DEFAULT_BATCH = 16

# on_layer(slot, rows, h, keep, valid): see Capture.run
LayerCallback = Callable[[int, list[int], Any, Any, Any], None]


def load_model(model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu") -> tuple[Any, Any]:
    """(model, HF tokenizer) through the serving engine's own loader, so dtype and layers match."""
    from prismgate.engines.hf.adapters import load_adapter

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise invalid(f"{path}: not a Hugging Face model folder (no config.json)")
    adapter = load_adapter(path, device=device, dtype=dtype)
    return adapter.model, adapter.tokenizer


@contextlib.contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """``threads`` torch threads, seed 0 and inference mode for the block; the thread count is restored after."""
    import torch

    if threads < 1:
        raise invalid(f"threads must be >= 1, got {threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(previous)


def check_layers(layers: Sequence[int], n_layers: int) -> tuple[int, ...]:
    """Layers as a sorted tuple; a clear error for unknown, repeated or missing layers."""
    if not layers:
        raise invalid("no layers given")
    if any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) for x in layers):
        raise invalid(f"layers must be integers, got {list(layers)}")
    bad = sorted(int(x) for x in layers if not 0 <= x < n_layers)
    if bad:
        raise invalid(f"layers {bad} do not exist: the model has {n_layers} decoder layers (0-{n_layers - 1})")
    if len(set(layers)) != len(layers):
        raise invalid(f"layers repeat: {list(layers)}")
    return tuple(sorted(int(x) for x in layers))


def token_keep(norms: Any, valid: Any, factor: float | None) -> Any:
    """Which tokens ``[batch, time]`` count toward a prompt's mean (torch bool tensor).

    A valid token counts unless its norm exceeds ``factor`` times the lower median norm of
    its prompt's valid tokens at that layer. Such tokens are attention sinks with massive
    activations (figures in docs/benchmarks.md): nearly constant vectors that would otherwise
    dominate a prompt's mean. At least half of a prompt's valid tokens always count.
    """
    import torch

    keep = valid.clone()
    if factor:
        masked = torch.where(valid, norms, torch.full_like(norms, float("nan")))
        median = torch.nanmedian(masked, dim=1).values
        keep &= norms <= factor * median[:, None]
    return keep


@dataclass(frozen=True)
class PromptMeans:
    means: npt.NDArray[np.float64]  # [n_prompts, n_layers, hidden]
    tokens: npt.NDArray[np.int64]  # [n_prompts] tokens eligible for the mean (after skip_first)
    excluded: npt.NDArray[np.int64]  # [n_prompts, n_layers] of those, left out as massive-norm outliers


class _StopForward(Exception):
    """Raised by the hook on the deepest layer needed: the rest of the model is never run."""


@dataclass(frozen=True)
class Capture:
    """How prompts are batched and which of their tokens count; one per build, so every pass sees the same tokens.

    Call its passes under :func:`deterministic_torch` for reproducible bits.
    """

    batch_size: int = DEFAULT_BATCH
    skip_first: int = SKIP_FIRST
    outlier_factor: float | None = OUTLIER_FACTOR
    pad_id: int = 0
    on_batch: Callable[[int, int], None] | None = None  # (batches done, batches in the pass): progress for long builds

    def run(
        self, model: Any, token_ids: Sequence[Sequence[int]], layers: Sequence[int], on_layer: LayerCallback
    ) -> tuple[int, ...]:
        """Run every prompt, calling ``on_layer(slot, rows, h, keep, valid)`` after each chosen layer.

        ``h`` is that layer's output in float64 ``[batch, time, hidden]``, ``keep`` the tokens that
        count (:func:`token_keep`), ``valid`` those after ``skip_first`` and before padding.
        Prompts run in batches sorted by (length, ids), right-padded (every real token keeps its
        position and causal context); the forward stops after the deepest chosen layer.
        """
        import torch

        if self.batch_size < 1:
            raise invalid(f"batch size must be >= 1, got {self.batch_size}")
        if self.skip_first < 0:
            raise invalid(f"skip_first must be >= 0, got {self.skip_first}")
        blocks = decoder_layers(model)
        layers = check_layers(layers, len(blocks))
        short = [i for i, ids in enumerate(token_ids) if len(ids) <= self.skip_first]
        if short:
            raise invalid(f"{len(short)} prompt(s) have {self.skip_first} token(s) or fewer: nothing left to average")
        device = next(model.parameters()).device
        order = sorted(range(len(token_ids)), key=lambda i: (len(token_ids[i]), list(token_ids[i])))
        state: dict[str, Any] = {}

        def hook_for(slot: int, last: bool) -> Any:
            def hook(_module: Any, _args: Any, output: Any) -> None:
                h = output[0] if isinstance(output, tuple) else output  # [batch, time, hidden]
                h64 = h.to(torch.float64)
                keep = token_keep(h64.norm(dim=-1), state["valid"], self.outlier_factor)
                on_layer(slot, state["rows"], h64, keep, state["valid"])
                if last:
                    raise _StopForward

            return hook

        handles = [
            blocks[layer].register_forward_hook(hook_for(i, i == len(layers) - 1)) for i, layer in enumerate(layers)
        ]
        try:
            for start in range(0, len(order), self.batch_size):
                rows = order[start : start + self.batch_size]
                width = max(len(token_ids[r]) for r in rows)
                ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                valid = torch.zeros((len(rows), width), dtype=torch.bool)
                for b, r in enumerate(rows):
                    n = len(token_ids[r])
                    ids[b, :n] = torch.tensor(list(token_ids[r]), dtype=torch.long)
                    mask[b, :n] = 1
                    valid[b, self.skip_first : n] = True
                state.update(rows=rows, valid=valid.to(device))
                try:
                    with torch.inference_mode():
                        model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
                except _StopForward:
                    pass
                else:
                    raise RuntimeError("capture hooks did not fire on the deepest requested layer")
                if self.on_batch is not None:
                    self.on_batch(start // self.batch_size + 1, -(-len(order) // self.batch_size))
        finally:
            for handle in handles:
                handle.remove()
        return layers

    def prompt_means(self, model: Any, token_ids: Sequence[Sequence[int]], layers: Sequence[int]) -> PromptMeans:
        """Per-prompt mean residual stream after each layer (see :class:`PromptMeans`).

        The mean covers tokens ``skip_first..n-1`` of each prompt, less massive-norm tokens
        (:func:`token_keep`).
        """
        import torch

        hidden = hidden_size(model)
        out = PromptMeans(
            means=np.zeros((len(token_ids), len(layers), hidden), dtype=np.float64),
            tokens=np.array([max(len(ids) - self.skip_first, 0) for ids in token_ids], dtype=np.int64),
            excluded=np.zeros((len(token_ids), len(layers)), dtype=np.int64),
        )

        def on_layer(slot: int, rows: list[int], h: Any, keep: Any, valid: Any) -> None:
            kept = keep.sum(dim=1)
            weights = keep.to(h.dtype) / kept.clamp(min=1).to(h.dtype)[:, None]
            out.means[rows, slot] = torch.einsum("bt,bth->bh", weights, h).cpu().numpy()
            out.excluded[rows, slot] = (valid.sum(dim=1) - kept).cpu().numpy()

        self.run(model, token_ids, layers, on_layer)
        return out

    def token_projections(
        self,
        model: Any,
        token_ids: Sequence[Sequence[int]],
        layers: Sequence[int],
        matrices: npt.NDArray[np.float64],
    ) -> list[list[npt.NDArray[np.float64]]]:
        """Per prompt and layer ``[kept tokens, k]``: each counted token's state projected on ``matrices[l]``.

        ``matrices`` is ``[n_layers, hidden, k]``.
        The tokens are the same ones the means average over, so token-level scores match the pack.
        """
        import torch

        mats = [torch.from_numpy(np.ascontiguousarray(m, dtype=np.float64)) for m in matrices]
        parts: dict[tuple[int, int], npt.NDArray[np.float64]] = {}

        def on_layer(slot: int, rows: list[int], h: Any, keep: Any, valid: Any) -> None:
            proj = (h @ mats[slot].to(h.device)).cpu().numpy()  # [batch, time, k]
            mask = keep.cpu().numpy()
            for b, r in enumerate(rows):
                parts[(r, slot)] = proj[b][mask[b]]

        self.run(model, token_ids, layers, on_layer)
        return [[parts[(r, slot)] for slot in range(len(matrices))] for r in range(len(token_ids))]


def collect_prompt_means(
    model: Any,
    token_ids: Sequence[Sequence[int]],
    layers: Sequence[int],
    *,
    batch_size: int = DEFAULT_BATCH,
    skip_first: int = SKIP_FIRST,
    outlier_factor: float | None = OUTLIER_FACTOR,
    pad_id: int = 0,
) -> PromptMeans:
    """:meth:`Capture.prompt_means` with the capture options as keywords."""
    return Capture(batch_size, skip_first, outlier_factor, pad_id).prompt_means(model, token_ids, layers)


def collect_token_projections(
    model: Any,
    token_ids: Sequence[Sequence[int]],
    layers: Sequence[int],
    matrices: npt.NDArray[np.float64],
    *,
    batch_size: int = DEFAULT_BATCH,
    skip_first: int = SKIP_FIRST,
    outlier_factor: float | None = OUTLIER_FACTOR,
    pad_id: int = 0,
) -> list[list[npt.NDArray[np.float64]]]:
    """:meth:`Capture.token_projections` with the capture options as keywords."""
    return Capture(batch_size, skip_first, outlier_factor, pad_id).token_projections(model, token_ids, layers, matrices)


@dataclass(frozen=True)
class CapturedPrompts:
    """Every distinct prompt of a build, its token ids and its mean residual stream, looked up by text and layer."""

    token_ids: list[list[int]]  # by row
    rows: dict[str, int]  # prompt text -> row
    slots: dict[int, int]  # layer -> its index on the layer axis of ``collected``
    collected: PromptMeans

    def means(self, prompts: Sequence[str], layer: int) -> npt.NDArray[np.float64]:
        """``[len(prompts), hidden]``: the mean residual stream of each prompt after ``layer``."""
        return self.collected.means[[self.rows[p] for p in prompts], self.slots[layer]]


def capture_prompts(
    model: Any, tokenizer: Any, sets: Sequence[PromptSet], layers: tuple[int, ...], capture: Capture, threads: int
) -> CapturedPrompts:
    """Encode every distinct prompt of ``sets`` once (sorted, raw text) and capture its means at ``layers``."""
    texts = sorted({p for s in sets for p in (*s.positive, *s.negative)})
    token_ids = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    with deterministic_torch(threads):
        collected = capture.prompt_means(model, token_ids, layers)
    return CapturedPrompts(
        token_ids=token_ids,
        rows={t: i for i, t in enumerate(texts)},
        slots={layer: i for i, layer in enumerate(layers)},
        collected=collected,
    )
