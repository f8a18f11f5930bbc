"""Build concept packs from contrastive prompt sets, and report how well each direction separates.

A concept is a prompt set: ``{"name", "description", "positive": [...], "negative": [...]}``
(``prompt_sets/*.json``; pairs at the same index share a topic, so held-out folds keep them
together). Its direction at layer L is the difference of means of the residual stream after
decoder layer L, normalised::

    m(p)      = mean over tokens 1..n-1 of prompt p of h_L(token)
    direction = normalize(mean_p∈pos m(p) - mean_p∈neg m(p))

Why these choices:

* **h_L is what decoder layer L returns**, read by forward hooks on the same layer objects
  the serving engine's :class:`~prismgate.engines.readouts.probe.ReadoutProbe` hooks, on the
  model loaded by the engine's own loader (same dtype, bf16 by default). HF's
  ``hidden_states[-1]`` is not used: it has the final norm applied.
* **All tokens but the first.** Readouts are served for every token, so the direction should
  separate the typical token of a prompt, not only its last one (the last token mixes in
  "end of sentence" features, and a handful of tokens per prompt is a noisy estimate).
  Position 0 is left out: it is the attention sink, whose residual norm is about 100 times
  that of other tokens in SmolLM2 (measured: ~21000 vs ~200 from layer 16 on), so one
  token would dominate each prompt's mean with content that has nothing to do with the
  concept.
* **Prompts are raw text** (no chat template), encoded like the engine encodes text, so a
  direction describes the text, not the framing around it.
* **Deterministic**: prompts are de-duplicated and run in sorted order (by length, then ids)
  in fixed-size right-padded batches (right padding keeps every real token's position and
  causal context exactly as unbatched), one thread, ``torch.manual_seed(0)``, hidden states
  accumulated in float64 in a fixed order. Two builds on one machine give identical bits.

The separation report holds out folds of pairs (k-fold, pair i in fold i mod k), builds the
direction on the rest, and scores held-out prompts by their mean projection against the
midpoint of the training classes: accuracy and Cohen's d per concept and layer. It is how
:data:`DEFAULT_LAYERS` were chosen.

Rebuild the default pack (about 7 s on one thread plus 2 s loading; --report adds a second pass)::

    OMP_NUM_THREADS=1 prismgate concepts build --out engines/readouts/packs/smollm2-135m-instruct.safetensors --report
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from prismgate.core.errors import GatewayError, invalid
from prismgate.engines.readouts.pack import DEFAULT_PACKS, ConceptPack
from prismgate.engines.readouts.probe import decoder_layers

PROMPT_SETS_DIR = Path(__file__).parent / "prompt_sets"
DEFAULT_PACK = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"

# Chosen for SmolLM2-135M-Instruct (30 layers) from the held-out separation report of the shipped
# prompt sets (`prismgate concepts build --report-layers all --report`, 4 folds). Every concept is
# separated at the prompt level from layer 0 on (mean accuracy 0.95-0.99), so the choice follows
# token accuracy, which is what a served readout is: 0.68 at L0, 0.75 at L4-L9 (lexical features),
# rising to 0.83 at L12 and a plateau of 0.87-0.89 from L14 to L28 (Cohen's d peaks at L16, 7.1);
# the last layer drops to 0.79 (its output is shaped for the unembedding), so it is left out.
# Two early layers show the lexical stage; six cover the plateau.
DEFAULT_LAYERS: tuple[int, ...] = (4, 8, 12, 16, 19, 22, 25, 28)
DEFAULT_LAYERS_NOTE = (
    "layers 4,8,12,16,19,22,25,28 of 30 chosen from the held-out separation report "
    "(prismgate concepts build --report-layers all --report): held-out token accuracy, averaged over concepts, "
    "is 0.76/0.75 at L4/L8 (lexical stage), 0.83 at L12, 0.87-0.89 from L14 to L28, 0.79 at the last layer (excluded)"
)

SKIP_FIRST = 1  # tokens left out at the start of each prompt (the attention sink)
OUTLIER_FACTOR = 3.0  # tokens above this multiple of their prompt's median norm are left out
DEFAULT_BATCH = 16
DEFAULT_FOLDS = 4


# -- prompt sets -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptSet:
    """One concept: prompts that show it (``positive``) and matched ones that do not."""

    name: str
    description: str
    positive: tuple[str, ...]
    negative: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise invalid(f"prompt set name {self.name!r} must be non-empty letters, digits, '_' or '-'")
        for side in ("positive", "negative"):
            prompts = getattr(self, side)
            if not prompts:
                raise invalid(f"prompt set {self.name!r} has no {side} prompts")
            bad = [i for i, p in enumerate(prompts) if not isinstance(p, str) or not p.strip()]
            if bad:
                raise invalid(f"prompt set {self.name!r}: {side} prompts {bad} are empty or not strings")

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "prompt set") -> PromptSet:
        if not isinstance(data, dict):
            raise invalid(f"{source}: expected a JSON object with name, description, positive, negative")
        missing = [k for k in ("name", "positive", "negative") if k not in data]
        if missing:
            raise invalid(f"{source}: missing {', '.join(missing)}")
        for side in ("positive", "negative"):
            if not isinstance(data[side], list):
                raise invalid(f"{source}: {side!r} must be a list of strings")
        return cls(
            name=str(data["name"]),
            description=str(data.get("description", "")),
            positive=tuple(data["positive"]),
            negative=tuple(data["negative"]),
        )

    @classmethod
    def load(cls, path: str | Path) -> PromptSet:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise invalid(f"cannot read prompt set {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise invalid(f"prompt set {path} is not valid JSON: {e}") from None
        return cls.from_dict(data, source=str(path))


def load_prompt_sets(sources: Sequence[str | Path]) -> list[PromptSet]:
    """Prompt sets from files and folders (every ``*.json`` in a folder), sorted by name."""
    if not sources:
        raise invalid("no prompt sets given")
    files: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            found = sorted(path.glob("*.json"))
            if not found:
                raise invalid(f"prompt set folder {path} holds no *.json files")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise invalid(f"prompt set {path} does not exist")
    return _checked_sets([PromptSet.load(f) for f in files])


def _checked_sets(sets: Sequence[PromptSet | str | Path]) -> list[PromptSet]:
    if not sets:
        raise invalid("no prompt sets given")
    if all(isinstance(s, (str, Path)) for s in sets):
        return load_prompt_sets([Path(s) for s in sets])  # type: ignore[arg-type]
    if not all(isinstance(s, PromptSet) for s in sets):
        raise invalid("prompt sets must all be PromptSet objects or all be paths")
    typed = sorted((s for s in sets if isinstance(s, PromptSet)), key=lambda s: s.name)
    names = [s.name for s in typed]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise invalid(f"prompt set names must be unique; repeated: {', '.join(dupes)}")
    return typed


def prompt_sets_digest(sets: Sequence[PromptSet]) -> str:
    """A short hash of the prompt sets' contents, recorded in the pack to tie it to its inputs."""
    canon = json.dumps([[s.name, s.description, list(s.positive), list(s.negative)] for s in sets], ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


# -- activations -----------------------------------------------------------------------------


class _StopForward(Exception):
    """Raised by the hook on the deepest layer needed: the rest of the model is never run."""


@contextlib.contextmanager
def _deterministic_torch(threads: int) -> Iterator[None]:
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


@dataclass(frozen=True)
class PromptMeans:
    means: npt.NDArray[np.float64]  # [n_prompts, n_layers, hidden]
    tokens: npt.NDArray[np.int64]  # [n_prompts] tokens eligible for the mean (after skip_first)
    excluded: npt.NDArray[np.int64]  # [n_prompts, n_layers] of those, left out as massive-norm outliers


def token_keep(norms: Any, valid: Any, factor: float | None) -> Any:
    """Which tokens ``[batch, time]`` count toward a prompt's mean (torch bool tensor).

    A valid token counts unless its norm exceeds ``factor`` times the lower median norm of
    its prompt's valid tokens at that layer. Such tokens are attention sinks with massive
    activations (SmolLM2: ' the' at layers 2-8 is ~5x the median; a second sink at position 1
    or 2 from layer 11 on is ~150x): nearly constant vectors that would otherwise dominate a
    prompt's mean. At least half of a prompt's valid tokens always count.
    """
    import torch

    keep = valid.clone()
    if factor:
        masked = torch.where(valid, norms, torch.full_like(norms, float("nan")))
        median = torch.nanmedian(masked, dim=1).values
        keep &= norms <= factor * median[:, None]
    return keep


def _run_layers(
    model: Any,
    token_ids: Sequence[Sequence[int]],
    layers: Sequence[int],
    on_layer: Callable[[int, list[int], Any, Any, Any], None],
    *,
    batch_size: int,
    skip_first: int,
    outlier_factor: float | None,
    pad_id: int,
) -> tuple[int, ...]:
    """Run every prompt, calling ``on_layer(slot, rows, h, keep, valid)`` after each chosen layer.

    ``h`` is that layer's output in float64 ``[batch, time, hidden]``, ``keep`` the tokens that
    count (:func:`token_keep`), ``valid`` those after ``skip_first`` and before padding.
    Prompts run in batches sorted by (length, ids), right-padded (every real token keeps its
    position and causal context); the forward stops after the deepest chosen layer.
    """
    import torch

    if batch_size < 1:
        raise invalid(f"batch size must be >= 1, got {batch_size}")
    if skip_first < 0:
        raise invalid(f"skip_first must be >= 0, got {skip_first}")
    blocks = decoder_layers(model)
    layers = check_layers(layers, len(blocks))
    short = [i for i, ids in enumerate(token_ids) if len(ids) <= skip_first]
    if short:
        raise invalid(f"{len(short)} prompt(s) have {skip_first} token(s) or fewer: nothing left to average")
    device = next(model.parameters()).device
    order = sorted(range(len(token_ids)), key=lambda i: (len(token_ids[i]), list(token_ids[i])))
    state: dict[str, Any] = {}

    def hook_for(slot: int, last: bool) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            h = output[0] if isinstance(output, tuple) else output  # [batch, time, hidden]
            h64 = h.to(torch.float64)
            keep = token_keep(h64.norm(dim=-1), state["valid"], outlier_factor)
            on_layer(slot, state["rows"], h64, keep, state["valid"])
            if last:
                raise _StopForward

        return hook

    handles = [blocks[layer].register_forward_hook(hook_for(i, i == len(layers) - 1)) for i, layer in enumerate(layers)]
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(len(token_ids[r]) for r in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            valid = torch.zeros((len(rows), width), dtype=torch.bool)
            for b, r in enumerate(rows):
                n = len(token_ids[r])
                ids[b, :n] = torch.tensor(list(token_ids[r]), dtype=torch.long)
                mask[b, :n] = 1
                valid[b, skip_first:n] = True
            state.update(rows=rows, valid=valid.to(device))
            try:
                with torch.inference_mode():
                    model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
            except _StopForward:
                pass
            else:
                raise RuntimeError("capture hooks did not fire on the deepest requested layer")
    finally:
        for handle in handles:
            handle.remove()
    return layers


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
    """Per-prompt mean residual stream after each layer (see :class:`PromptMeans`).

    The mean covers tokens ``skip_first..n-1`` of each prompt, less massive-norm tokens
    (:func:`token_keep`). Call under :func:`_deterministic_torch` for reproducible bits.
    """
    import torch

    hidden = int(model.config.get_text_config().hidden_size)
    out = PromptMeans(
        means=np.zeros((len(token_ids), len(layers), hidden), dtype=np.float64),
        tokens=np.array([max(len(ids) - skip_first, 0) for ids in token_ids], dtype=np.int64),
        excluded=np.zeros((len(token_ids), len(layers)), dtype=np.int64),
    )

    def on_layer(slot: int, rows: list[int], h: Any, keep: Any, valid: Any) -> None:
        kept = keep.sum(dim=1)
        weights = keep.to(h.dtype) / kept.clamp(min=1).to(h.dtype)[:, None]
        out.means[rows, slot] = torch.einsum("bt,bth->bh", weights, h).cpu().numpy()
        out.excluded[rows, slot] = (valid.sum(dim=1) - kept).cpu().numpy()

    _run_layers(
        model,
        token_ids,
        layers,
        on_layer,
        batch_size=batch_size,
        skip_first=skip_first,
        outlier_factor=outlier_factor,
        pad_id=pad_id,
    )
    return out


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

    _run_layers(
        model,
        token_ids,
        layers,
        on_layer,
        batch_size=batch_size,
        skip_first=skip_first,
        outlier_factor=outlier_factor,
        pad_id=pad_id,
    )
    return [[parts[(r, slot)] for slot in range(len(matrices))] for r in range(len(token_ids))]


def direction(pos: npt.NDArray[np.float64], neg: npt.NDArray[np.float64], *, what: str = "") -> npt.NDArray[np.float64]:
    """normalize(mean(pos) - mean(neg)) over the first axis, in float64."""
    diff = pos.mean(axis=0) - neg.mean(axis=0)
    norm = float(np.linalg.norm(diff))
    if not np.isfinite(norm) or norm == 0.0:
        raise invalid(f"{what or 'concept'}: positive and negative prompts have the same mean; no direction")
    return diff / norm


# -- separation report -----------------------------------------------------------------------


@dataclass(frozen=True)
class Separation:
    """How well one concept's direction at one layer separates held-out prompts and their tokens."""

    concept: str
    layer: int
    accuracy: float  # held-out prompts whose mean projection is on the right side of the training midpoint
    cohens_d: float  # (mean_pos - mean_neg) / pooled std of those held-out prompt projections
    token_accuracy: float  # held-out tokens (those the means count) on the right side of the same midpoint
    prompts: int  # held-out prompts scored over all folds (every prompt once)
    tokens: int  # held-out tokens scored


@dataclass(frozen=True)
class SeparationReport:
    folds: int
    rows: tuple[Separation, ...]
    excluded: dict[int, float] = field(default_factory=dict)  # layer -> fraction of tokens left out as outliers

    @property
    def concepts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.concept for r in self.rows))

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({r.layer for r in self.rows}))

    def get(self, concept: str, layer: int) -> Separation:
        for r in self.rows:
            if r.concept == concept and r.layer == layer:
                return r
        raise KeyError((concept, layer))

    def table(self) -> str:
        """Concepts down, layers across; one block per measure."""
        concepts, layers = self.concepts, self.layers
        width = max(12, *(len(c) for c in concepts))
        head = " " * width + "".join(f"{'L' + str(layer):>6}" for layer in layers)
        lines = [f"held-out separation, {self.folds}-fold over prompt pairs"]
        for title, attr, fmt in (
            ("prompt accuracy (mean projection of each held-out prompt)", "accuracy", "{:>6.2f}"),
            ("Cohen's d of held-out prompt projections", "cohens_d", "{:>6.1f}"),
            ("token accuracy (each held-out token's readout)", "token_accuracy", "{:>6.2f}"),
        ):
            lines += ["", title, head]
            for c in concepts:
                lines.append(f"{c:<{width}}" + "".join(fmt.format(getattr(self.get(c, x), attr)) for x in layers))
            means = [float(np.mean([getattr(self.get(c, x), attr) for c in concepts])) for x in layers]
            lines.append(f"{'mean':<{width}}" + "".join(fmt.format(m) for m in means))
        if self.excluded:
            lines += ["", f"{'outliers':<{width}}" + "".join(f"{self.excluded.get(x, 0.0):>6.1%}" for x in layers)]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "folds": self.folds,
            "excluded": {str(k): v for k, v in sorted(self.excluded.items())},
            "rows": [
                {
                    "concept": r.concept,
                    "layer": r.layer,
                    "accuracy": r.accuracy,
                    "cohens_d": r.cohens_d,
                    "token_accuracy": r.token_accuracy,
                    "prompts": r.prompts,
                    "tokens": r.tokens,
                }
                for r in self.rows
            ],
        }


@dataclass(frozen=True)
class FoldFit:
    """A direction fitted without one fold, and the prompts of that fold (indices into each side)."""

    direction: npt.NDArray[np.float64]
    mid: float  # midpoint of the training classes' mean projections: the decision threshold
    heldout_pos: npt.NDArray[np.intp]
    heldout_neg: npt.NDArray[np.intp]


def fit_folds(name: str, pos: npt.NDArray[np.float64], neg: npt.NDArray[np.float64], folds: int) -> list[FoldFit]:
    """k-fold fits of one concept at one layer; prompt i of either side is in fold ``i % k``.

    Pairs share an index, so a topic never sits on both sides of a split.
    """
    folds = min(folds, len(pos), len(neg))
    if folds < 2:
        raise invalid(f"prompt set {name!r}: a separation report needs at least 2 prompts on each side")
    fold_pos, fold_neg = np.arange(len(pos)) % folds, np.arange(len(neg)) % folds
    fits = []
    for k in range(folds):
        tp, tn = pos[fold_pos != k], neg[fold_neg != k]
        d = direction(tp, tn, what=name)
        mid = 0.5 * (float((tp @ d).mean()) + float((tn @ d).mean()))
        fits.append(FoldFit(d, mid, np.flatnonzero(fold_pos == k), np.flatnonzero(fold_neg == k)))
    return fits


def _cohens_d(pos: npt.NDArray[np.float64], neg: npt.NDArray[np.float64]) -> float:
    n_p, n_n = len(pos), len(neg)
    pooled = ((n_p - 1) * pos.var(ddof=1) + (n_n - 1) * neg.var(ddof=1)) / max(n_p + n_n - 2, 1)
    spread = float(np.sqrt(pooled))
    return float((pos.mean() - neg.mean()) / spread) if spread > 0 else float("inf")


def separation(
    name: str,
    layer: int,
    pos: npt.NDArray[np.float64],
    neg: npt.NDArray[np.float64],
    fits: Sequence[FoldFit],
    pos_tokens: Sequence[Sequence[npt.NDArray[np.float64]]] | None = None,
    neg_tokens: Sequence[Sequence[npt.NDArray[np.float64]]] | None = None,
) -> Separation:
    """Score held-out prompts (``pos``/``neg``: ``[n, hidden]`` prompt means) against their fold's fit.

    ``pos_tokens[k][i]``, if given, are the token projections of positive prompt i on fold k's
    direction (likewise ``neg_tokens``): they give the token accuracy.
    """
    sp = np.concatenate([pos[f.heldout_pos] @ f.direction - f.mid for f in fits])
    sn = np.concatenate([neg[f.heldout_neg] @ f.direction - f.mid for f in fits])
    right = tokens = 0
    if pos_tokens is not None and neg_tokens is not None:
        for k, f in enumerate(fits):
            for i in f.heldout_pos:
                t = pos_tokens[k][i] - f.mid
                right, tokens = right + int((t > 0).sum()), tokens + len(t)
            for i in f.heldout_neg:
                t = neg_tokens[k][i] - f.mid
                right, tokens = right + int((t < 0).sum()), tokens + len(t)
    accuracy = (int((sp > 0).sum()) + int((sn < 0).sum())) / (len(sp) + len(sn))
    return Separation(
        concept=name,
        layer=layer,
        accuracy=accuracy,
        cohens_d=_cohens_d(sp, sn),
        token_accuracy=right / tokens if tokens else float("nan"),
        prompts=len(sp) + len(sn),
        tokens=tokens,
    )


# -- building --------------------------------------------------------------------------------


def _method(
    sets: Sequence[PromptSet],
    *,
    dtype: str,
    skip_first: int,
    outlier_factor: float | None,
    batch_size: int,
    layer_note: str,
) -> str:
    """The pack's ``method`` metadata: enough to know what a direction means and to rebuild it."""
    n_pos = sum(len(s.positive) for s in sets)
    n_neg = sum(len(s.negative) for s in sets)
    tokens = f"tokens {skip_first}..n-1 (tokens before {skip_first} left out: attention sink)"
    if outlier_factor:
        tokens += f", less tokens with norm > {outlier_factor:g}x the prompt's median norm (massive activations)"
    parts = [
        "difference of means: direction = normalize(mean over positive prompts - mean over negative prompts) "
        f"of each prompt's mean residual stream after decoder layer L over {tokens}",
        f"raw text prompts (no chat template): {n_pos} positive / {n_neg} negative, "
        f"prompt sets sha256:{prompt_sets_digest(sets)}",
        f"model dtype {dtype}, float64 accumulation, 1 thread, sorted right-padded batches of {batch_size}",
    ]
    if layer_note:
        parts.append(layer_note)
    return "; ".join(parts)


def load_model(model_dir: str | Path, *, dtype: str = "auto", device: str = "cpu") -> tuple[Any, Any]:
    """(model, HF tokenizer) through the serving engine's own loader, so dtype and layers match."""
    from prismgate.engines.hf.adapters import load_adapter

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise invalid(f"{path}: not a Hugging Face model folder (no config.json)")
    adapter = load_adapter(path, device=device, dtype=dtype)
    return adapter.model, adapter.tokenizer


def build_pack_and_report(
    model_dir: str | Path,
    prompt_sets: Sequence[PromptSet | str | Path],
    layers: Sequence[int],
    *,
    model_id: str | None = None,
    report_layers: Sequence[int] | None = None,
    folds: int = DEFAULT_FOLDS,
    dtype: str = "auto",
    device: str = "cpu",
    batch_size: int = DEFAULT_BATCH,
    skip_first: int = SKIP_FIRST,
    outlier_factor: float | None = OUTLIER_FACTOR,
    threads: int = 1,
    layer_note: str = "",
    model: Any = None,
    tokenizer: Any = None,
) -> tuple[ConceptPack, SeparationReport | None]:
    """Build a pack at ``layers`` and, if ``report_layers`` is given, a held-out separation report there.

    ``model``/``tokenizer`` may be passed already loaded (``dtype``/``device`` are then unused);
    otherwise they are loaded from ``model_dir`` by the engine's loader. ``layer_note`` (why
    these layers) is appended to the pack's ``method``.
    """
    sets = _checked_sets(prompt_sets)
    if model is None or tokenizer is None:
        model, tokenizer = load_model(model_dir, dtype=dtype, device=device)
    n_layers = len(decoder_layers(model))
    layers = check_layers(layers, n_layers)
    wanted = (
        layers if report_layers is None else tuple(sorted(set(layers) | set(check_layers(report_layers, n_layers))))
    )

    texts = sorted({p for s in sets for p in (*s.positive, *s.negative)})
    token_ids = [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with _deterministic_torch(threads):
        collected = collect_prompt_means(
            model,
            token_ids,
            wanted,
            batch_size=batch_size,
            skip_first=skip_first,
            outlier_factor=outlier_factor,
            pad_id=pad,
        )
    means = collected.means
    row = {t: i for i, t in enumerate(texts)}

    def side(prompts: Sequence[str], slot: int) -> npt.NDArray[np.float64]:
        return means[[row[p] for p in prompts], slot]

    slots = {layer: i for i, layer in enumerate(wanted)}
    directions = np.stack(
        [
            np.stack([direction(side(s.positive, slots[L]), side(s.negative, slots[L]), what=s.name) for s in sets])
            for L in layers
        ]
    ).astype(np.float32)
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)  # exact unit rows after the cast
    pack = ConceptPack(
        directions=directions,
        layers=layers,
        concepts=tuple(s.name for s in sets),
        model_id=model_id or Path(model_dir).resolve().name,
        method=_method(
            sets,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            skip_first=skip_first,
            outlier_factor=outlier_factor,
            batch_size=batch_size,
            layer_note=layer_note,
        ),
        descriptions={s.name: s.description for s in sets},
    )
    report = None
    if report_layers is not None:
        report_at = tuple(sorted(set(report_layers)))
        fits = {
            (st.name, L): fit_folds(st.name, side(st.positive, slots[L]), side(st.negative, slots[L]), folds)
            for st in sets
            for L in report_at
        }
        # One more pass: every token's projection on every fold's direction, for token accuracy.
        columns = {
            (st.name, k): c
            for c, (st, k) in enumerate((st, k) for st in sets for k in range(len(fits[(st.name, report_at[0])])))
        }
        matrices = np.stack(
            [np.stack([fits[(name, L)][k].direction for (name, k) in columns], axis=1) for L in report_at]
        )
        with _deterministic_torch(threads):
            projections = collect_token_projections(
                model,
                token_ids,
                report_at,
                matrices,
                batch_size=batch_size,
                skip_first=skip_first,
                outlier_factor=outlier_factor,
                pad_id=pad,
            )

        def token_scores(prompts: Sequence[str], name: str, j: int) -> list[list[npt.NDArray[np.float64]]]:
            n_folds = len(fits[(name, report_at[0])])
            return [[projections[row[p]][j][:, columns[(name, k)]] for p in prompts] for k in range(n_folds)]

        total = max(int(collected.tokens.sum()), 1)
        report = SeparationReport(
            folds=folds,
            excluded={L: float(collected.excluded[:, slots[L]].sum()) / total for L in report_at},
            rows=tuple(
                separation(
                    st.name,
                    L,
                    side(st.positive, slots[L]),
                    side(st.negative, slots[L]),
                    fits[(st.name, L)],
                    token_scores(st.positive, st.name, j),
                    token_scores(st.negative, st.name, j),
                )
                for st in sets
                for j, L in enumerate(report_at)
            ),
        )
    return pack, report


def build_pack(
    model_dir: str | Path, prompt_sets: Sequence[PromptSet | str | Path], layers: Sequence[int], **options: Any
) -> ConceptPack:
    """A concept pack for the model in ``model_dir``; see :func:`build_pack_and_report` for options."""
    options.pop("report_layers", None)
    return build_pack_and_report(model_dir, prompt_sets, layers, **options)[0]


# -- command line ----------------------------------------------------------------------------


def _layer_list(text: str) -> list[int] | str:
    if text.strip() == "all":
        return "all"
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers (or 'all'), got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prismgate concepts",
        description="Build and inspect concept packs: unit directions in the residual stream that the gateway "
        "projects each token's hidden state onto (its 'readouts').",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,show}")

    b = sub.add_parser(
        "build",
        help="build a pack from contrastive prompt sets (difference of means)",
        description="Build a concept pack: for each prompt set and layer, the normalised difference between the "
        "mean residual stream of its positive and its negative prompts. Deterministic; runs on CPU.",
        epilog="example: OMP_NUM_THREADS=1 prismgate concepts build --out pack.safetensors --report",
    )
    b.add_argument(
        "--model", metavar="PATH", help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    b.add_argument(
        "--model-id", metavar="ID", help="model id recorded in the pack (default: the model's id or folder name)"
    )
    b.add_argument(
        "--prompt-sets",
        nargs="+",
        metavar="DIR_OR_FILE",
        default=[str(PROMPT_SETS_DIR)],
        help="prompt set JSON files and/or folders of them (default: the sets shipped with prismgate)",
    )
    b.add_argument(
        "--layers",
        type=_layer_list,
        metavar="L1,L2,...",
        help="decoder layers to read after, 0-based (default for the embedded model: "
        f"{','.join(map(str, DEFAULT_LAYERS))})",
    )
    b.add_argument("--out", required=True, metavar="PACK", help="where to write the pack (.safetensors)")
    b.add_argument("--report", action="store_true", help="print the held-out separation of each concept at each layer")
    b.add_argument(
        "--report-layers",
        type=_layer_list,
        metavar="all|L1,L2,...",
        help="layers to report on (default: the pack's layers; 'all' to choose layers)",
    )
    b.add_argument("--report-json", metavar="FILE", help="also write the separation report as JSON")
    b.add_argument(
        "--folds", type=int, default=DEFAULT_FOLDS, help="held-out folds for the report (default %(default)s)"
    )
    b.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="model dtype, as the engine serves it (default %(default)s = bfloat16)",
    )
    b.add_argument("--device", default="cpu", help="torch device (default %(default)s)")
    b.add_argument(
        "--batch-size", type=int, default=DEFAULT_BATCH, help="prompts per forward pass (default %(default)s)"
    )
    b.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s; 1 is reproducible)")

    s = sub.add_parser(
        "show",
        help="describe a pack (and check it against a model)",
        description="Print a pack's model, layers, concepts and method; with --model, check that it fits that "
        "model; with --text, print the readouts of each token of a text.",
    )
    s.add_argument(
        "pack", metavar="PACK", nargs="?", default=str(DEFAULT_PACK), help="pack file (default: the shipped pack)"
    )
    s.add_argument("--json", action="store_true", help="print the description as JSON")
    s.add_argument("--similarity", action="store_true", help="print cosine similarity between concepts, per layer")
    s.add_argument(
        "--model", metavar="PATH", help="check the pack against this model folder ('default': the embedded one)"
    )
    s.add_argument("--text", help="with --model: print the per-token readouts of this text")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``prismgate concepts {build,show} ...``; returns the exit status."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.command == "build":
            return _cmd_build(args)
        return _cmd_show(args)
    except GatewayError as e:
        print(f"prismgate concepts {args.command}: error: {e.message}", file=sys.stderr)
        return 2


def _resolve(path: str | None) -> tuple[Path, str, bool]:
    from prismgate.engines.models import DEFAULT_MODEL_ID, resolve_model

    if path in (None, "", "default"):
        folder, model_id = resolve_model(None)
        return folder, DEFAULT_MODEL_ID, True
    folder, model_id = resolve_model(path)
    return folder, model_id, False


def _cmd_build(args: argparse.Namespace) -> int:
    folder, model_id, is_default = _resolve(args.model)
    layers = args.layers
    if layers is None:
        if not is_default:
            raise invalid("--layers is required for a model other than the embedded default")
        layers = list(DEFAULT_LAYERS)
    sets = load_prompt_sets(args.prompt_sets)
    t0 = time.perf_counter()
    model, tokenizer = load_model(folder, dtype=args.dtype, device=args.device)
    n_layers = len(decoder_layers(model))
    if layers == "all":
        layers = list(range(n_layers))
    report_layers = None
    if args.report or args.report_json:
        rl = args.report_layers or layers
        report_layers = list(range(n_layers)) if rl == "all" else rl
    t1 = time.perf_counter()
    note = DEFAULT_LAYERS_NOTE if is_default and tuple(layers) == DEFAULT_LAYERS else ""
    pack, report = build_pack_and_report(
        folder,
        sets,
        layers,
        model_id=args.model_id or model_id,
        report_layers=report_layers,
        folds=args.folds,
        dtype=args.dtype,
        batch_size=args.batch_size,
        threads=args.threads,
        layer_note=note,
        model=model,
        tokenizer=tokenizer,
    )
    t2 = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pack.save(out)
    n_prompts = sum(len(s.positive) + len(s.negative) for s in sets)
    print(
        f"wrote {out}: {len(pack.concepts)} concepts x {len(pack.layers)} layers {list(pack.layers)}, hidden "
        f"{pack.hidden_size}, from {n_prompts} prompts (load {t1 - t0:.1f} s, build {t2 - t1:.1f} s)",
        file=sys.stderr,
    )
    if report is not None:
        if args.report:
            print(report.table())
        if args.report_json:
            Path(args.report_json).write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0


def describe(pack: ConceptPack) -> dict[str, Any]:
    return {
        "model_id": pack.model_id,
        "layers": list(pack.layers),
        "hidden_size": pack.hidden_size,
        "concepts": {c: pack.descriptions.get(c, "") for c in pack.concepts},
        "shape": list(pack.directions.shape),
        "method": pack.method,
    }


def _cmd_show(args: argparse.Namespace) -> int:
    pack = ConceptPack.load(args.pack)
    info = describe(pack)
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
    else:
        print(f"pack       {args.pack}")
        print(f"model      {pack.model_id}")
        print(f"layers     {', '.join(map(str, pack.layers))}  (residual stream after decoder layer L)")
        print(f"hidden     {pack.hidden_size}")
        print("concepts")
        width = max(len(c) for c in pack.concepts)
        for c in pack.concepts:
            print(f"  {c:<{width}}  {pack.descriptions.get(c, '')}")
        print(f"method     {pack.method}")
    if args.similarity:
        for i, layer in enumerate(pack.layers):
            sim = pack.directions[i] @ pack.directions[i].T
            print(f"cosine similarity at layer {layer}:")
            width = max(len(c) for c in pack.concepts)
            print(" " * (width + 2) + "".join(f"{c[:7]:>8}" for c in pack.concepts))
            for c, simrow in zip(pack.concepts, sim, strict=True):
                print(f"  {c:<{width}}" + "".join(f"{v:>8.2f}" for v in simrow))
    if args.model is not None:
        folder, _, _ = _resolve(args.model)
        model, tokenizer = load_model(folder)
        pack.check_model(len(decoder_layers(model)), int(model.config.get_text_config().hidden_size))
        print(f"fits       {folder}")
        if args.text:
            _print_readouts(model, tokenizer, pack, args.text)
    elif args.text:
        raise invalid("--text needs --model")
    return 0


def readouts(model: Any, tokenizer: Any, pack: ConceptPack, text: str) -> tuple[list[int], npt.NDArray[np.float32]]:
    """(token ids, ``[tokens, n_layers, n_concepts]`` readouts) of a text, through the engine's probe."""
    import torch

    from prismgate.engines.readouts.probe import ReadoutProbe

    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise invalid("the text has no tokens")
    probe = ReadoutProbe(model, pack)
    try:
        probe.enabled = True
        with _deterministic_torch(1):
            model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), use_cache=False)
        return ids, probe.take()
    finally:
        probe.remove()


def _print_readouts(model: Any, tokenizer: Any, pack: ConceptPack, text: str) -> None:
    ids, values = readouts(model, tokenizer, pack, text)
    layer = len(pack.layers) // 2
    print(f"readouts at layer {pack.layers[layer]} (position 0 is the attention sink: its values are not comparable)")
    print(f"{'token':<16}" + "".join(f"{c[:9]:>10}" for c in pack.concepts))
    for tid, row in zip(ids, values[:, layer], strict=True):
        print(f"{tokenizer.decode([tid])!r:<16}"[:16] + "".join(f"{v:>10.2f}" for v in row))


if __name__ == "__main__":
    raise SystemExit(main())
