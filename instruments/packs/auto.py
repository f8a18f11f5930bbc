"""``--concept-pack auto``: a concept pack for whatever model is served, built once and cached.

Any model a user serves gets readouts without a build step of their own: on first start the
shipped prompt sets (a bounded number of pairs each) run through the model, loaded by the
transformers engine's own loader and read by the same hooks as the serving probe; the held-out
separation report (:mod:`.report`) over every layer picks where to read (:func:`select_layers`);
where each concept steers and how hard is measured on the serving engine (:mod:`.steering_range`);
the pack is written to ``<cache>/<digest>.safetensors`` and every later start loads it as is.

The digest (:func:`pack_digest`) names the model's files and the build recipe, so a different
model, other prompt sets or another pair count get a pack of their own, and an edited model
folder is rebuilt rather than served a stale pack.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from prismgate.core.errors import invalid
from prismgate.engines.introspect import decoder_layers
from prismgate.engines.prepare import PackStep
from prismgate.engines.readouts.pack import FORMAT, ConceptPack
from prismgate.instruments.packs.build import PROMPT_SETS_DIR, build_pack_and_report
from prismgate.instruments.packs.capture import load_model
from prismgate.instruments.packs.prompt_sets import PromptSet, load_prompt_sets, prompt_sets_digest
from prismgate.instruments.packs.report import SeparationReport
from prismgate.instruments.packs.steering_range import measure_steering

DEFAULT_PAIRS = 8  # per concept: enough for the held-out report; build time grows with it (docs/steering.md)
MAX_LAYERS = 8  # layers a built pack reads after, as many as the embedded pack
PLATEAU = 0.03  # layers within this much of the best mean token accuracy count as equally good
RECIPE = 2  # bump when the build below changes what it writes: older cached packs are then rebuilt
_WHOLE_FILE = 16 << 20  # files up to this size are hashed whole; larger ones by header, tail, size, mtime
_EDGE = 1 << 20
_HF_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")

Progress = Callable[[str], None]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/prismgate/packs``, else ``~/.cache/prismgate/packs``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prismgate" / "packs"


def check_pairs(pairs: int) -> int:
    if pairs < 2:
        raise invalid(f"concept_pack_pairs must be >= 2 (the separation report holds out pairs), got {pairs}")
    return pairs


def bounded_sets(sets: Sequence[PromptSet], pairs: int) -> list[PromptSet]:
    """The first ``pairs`` pairs of each set: pairs share a topic by index, so they stay matched."""
    check_pairs(pairs)
    return [replace(s, positive=s.positive[:pairs], negative=s.negative[:pairs]) for s in sets]


def _file_identity(path: Path) -> bytes:
    """What names one model file's contents, cheaply enough to run on every start.

    A file in a Hugging Face cache is a link to a blob named by its own hash. Small files
    (config, tokenizer) are hashed whole. Large weight files would take seconds per gigabyte
    to hash, so they are named by size, modification time, and their first and last MiB
    (the safetensors header lists every tensor's name, shape and offset).
    """
    resolved = path.resolve()
    if resolved.parent.name == "blobs" and _HF_BLOB.fullmatch(resolved.name):
        return resolved.name.encode()
    stat = resolved.stat()
    digest = hashlib.sha256()
    with resolved.open("rb") as fh:
        if stat.st_size <= _WHOLE_FILE:
            digest.update(fh.read())
        else:
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
            digest.update(fh.read(_EDGE))
            fh.seek(-_EDGE, os.SEEK_END)
            digest.update(fh.read(_EDGE))
    return digest.digest()


def _model_files(folder: Path) -> tuple[tuple[str, int, int], ...]:
    files = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        stat = path.stat()
        files.append((path.name, stat.st_size, stat.st_mtime_ns))
    return tuple(files)


def pack_digest(folder: str | Path, *, pairs: int, dtype: str, prompt_sets: Path = PROMPT_SETS_DIR) -> str:
    """Hex digest naming a model folder's files together with the build recipe.

    Memoised on the folder's listing (names, sizes, mtimes), so callers on a hot path (the
    playground looks up the pack's file) pay for a directory listing only.
    """
    folder = Path(folder).resolve()
    if not (folder / "config.json").exists():
        raise invalid(f"{folder}: not a Hugging Face model folder (no config.json)")
    return model_digest(folder, _recipe(prompt_sets, pairs, dtype))


def model_digest(folder: Path, recipe: str) -> str:
    """Hex digest of the model files in ``folder`` (resolved, with a config.json) and a ``recipe`` string.

    Anything built from a model and cached by it (a concept pack, a trained SAE) is named by this.
    """
    return _digest(folder, _model_files(folder), recipe)


@functools.lru_cache(maxsize=16)
def _recipe(prompt_sets: Path, pairs: int, dtype: str) -> str:
    sets = bounded_sets(load_prompt_sets([prompt_sets]), pairs)
    return f"{FORMAT}|recipe {RECIPE}|pairs {pairs}|dtype {dtype}|sets {prompt_sets_digest(sets)}"


@functools.lru_cache(maxsize=16)
def _digest(folder: Path, files: tuple[tuple[str, int, int], ...], recipe: str) -> str:
    digest = hashlib.sha256(recipe.encode())
    for name, _size, _mtime in files:
        digest.update(name.encode() + b"\0" + _file_identity(folder / name))
    return digest.hexdigest()[:32]


def cached_pack_path(cache_dir: str | Path | None, folder: str | Path, *, pairs: int, dtype: str) -> Path:
    """Where the auto-built pack of the model in ``folder`` lives (whether or not it is built yet)."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return cache / f"{pack_digest(folder, pairs=pairs, dtype=dtype)}.safetensors"


def select_layers(report: SeparationReport, n_layers: int, count: int = MAX_LAYERS) -> tuple[tuple[int, ...], str]:
    """Up to ``count`` layers to read after, and a note saying why, from the held-out report.

    A served readout is one token's projection, so layers are ranked by held-out token accuracy
    averaged over concepts. The last layer is left out when there is a choice (its output is
    shaped for the unembedding). Layers within :data:`PLATEAU` of the best form the plateau;
    ``count`` of them are taken evenly spread, so the pack shows how a concept develops
    rather than several neighbours that read the same; a short plateau is topped up with the
    next best layers.
    """
    candidates = [x for x in report.layers if x != n_layers - 1] or list(report.layers)
    score = {x: float(np.mean([report.get(c, x).token_accuracy for c in report.concepts])) for x in candidates}
    best = max(score.values())
    plateau = [x for x in candidates if score[x] >= best - PLATEAU]
    if len(plateau) >= count:
        picked = {plateau[round(i)] for i in np.linspace(0, len(plateau) - 1, count)}
    else:
        rest = sorted((x for x in candidates if x not in plateau), key=lambda x: (-score[x], x))
        picked = set(plateau) | set(rest[: count - len(plateau)])
    layers = tuple(sorted(picked))
    note = (
        f"layers {','.join(map(str, layers))} of {n_layers} chosen by the held-out separation report "
        f"({report.folds}-fold) built with the pack: mean held-out token accuracy "
        + ", ".join(f"L{x} {score[x]:.2f}" for x in layers)
        + f" (best {best:.2f})"
    )
    return layers, note


def pack_at_layers(pack: ConceptPack, layers: tuple[int, ...], note: str) -> ConceptPack:
    """``pack`` kept at ``layers`` only (a subset of its own), ``note`` (why these) added to its method."""
    rows = [pack.layers.index(x) for x in layers]
    return replace(
        pack,
        directions=pack.directions[rows],
        layers=layers,
        centers=None if pack.centers is None else pack.centers[rows],
        scales=None if pack.scales is None else pack.scales[rows],
        method=pack.method + "; " + note,
    )


@dataclass(frozen=True)
class BuildStats:
    prompts: int
    layers: tuple[int, ...]
    load_s: float
    build_s: float  # directions and the layer choice, then the steering measurement (steer_s of it)
    steer_s: float = 0.0


def build_auto_pack(
    folder: str | Path,
    out: str | Path,
    *,
    model_id: str,
    pairs: int = DEFAULT_PAIRS,
    dtype: str = "auto",
    device: str = "cpu",
    threads: int = 1,
    progress: Progress | None = None,
) -> BuildStats:
    """Build the pack of the model in ``folder`` and write it to ``out``. Slow: run it off the event loop.

    The file appears whole or not at all (written beside it, then renamed), so a start that
    is killed mid-build never leaves a pack that later starts would trust.
    """
    say = progress or (lambda _text: None)
    sets = bounded_sets(load_prompt_sets([PROMPT_SETS_DIR]), pairs)
    n_prompts = len({p for s in sets for p in (*s.positive, *s.negative)})
    started = time.perf_counter()
    say("loading the model")
    model, tokenizer = load_model(folder, dtype=dtype, device=_device(device))
    try:
        loaded = time.perf_counter()
        n_layers = len(decoder_layers(model))
        every = list(range(n_layers))
        say(f"capturing {n_prompts} prompts x {n_layers} layers, then the separation report")
        pack, report = build_pack_and_report(
            folder,
            sets,
            every,
            model_id=model_id,
            report_layers=every,
            dtype=dtype,
            threads=threads,
            model=model,
            tokenizer=tokenizer,
            progress=say,
        )
    finally:
        del model
        _free_accelerator_memory()
    assert report is not None
    layers, note = select_layers(report, n_layers)
    pack = pack_at_layers(pack, layers, note)
    measuring = time.perf_counter()
    say("measuring where each concept steers and how hard")
    try:
        pack, _ = measure_steering(folder, pack, dtype=dtype, device=_device(device), threads=threads, progress=say)
    finally:
        _free_accelerator_memory()  # the measuring engine's weights too
    steered = time.perf_counter()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    pack.save(partial)
    partial.replace(out)
    return BuildStats(n_prompts, layers, loaded - started, time.perf_counter() - loaded, steered - measuring)


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _free_accelerator_memory() -> None:
    """Give the build's weights back before the serving engine loads its own (vLLM sizes its cache by what is free)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pack_step(
    folder: str | Path,
    path: Path,
    *,
    model_id: str,
    pairs: int = DEFAULT_PAIRS,
    dtype: str = "auto",
    device: str = "auto",
    threads: int = 1,
) -> PackStep:
    """The start's step that reuses or builds the pack at ``path`` (a :class:`~prismgate.engines.prepare.PackStep`)."""
    check_pairs(pairs)  # a bad pair count is a settings error, found before anything loads

    def build(out: Path, progress: Progress) -> BuildStats:
        return build_auto_pack(
            folder, out, model_id=model_id, pairs=pairs, dtype=dtype, device=device, threads=threads, progress=progress
        )

    return PackStep(build, path, model_id=model_id, pairs=pairs)
