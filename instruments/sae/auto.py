"""``sae = "auto"``: the SAE trained for the served model, shipped or cached by model digest.

The embedded model's SAE ships with prismgate (:data:`SHIPPED`), so tests, docs and the
playground have real features without a download or a training run. For any other model
``prismgate sae train`` writes one per layer to ``<cache>/<digest>/layer<L>/``, the digest naming
the model's files and the training recipe (:func:`recipe`) as ``--concept-pack auto`` names its
packs; a start with ``sae = "auto"`` loads every layer found there, and is refused with the
command to run when there is none.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from prismgate.core.errors import invalid
from prismgate.engines.sae import files
from prismgate.engines.sae.files import CFG_FILE
from prismgate.instruments.packs.auto import model_digest
from prismgate.instruments.sae.corpus import corpus, corpus_digest
from prismgate.instruments.sae.train import TrainConfig

RECIPE = 1  # bump when training changes what it writes: cached SAEs are then trained again
SHIPPED = Path(files.__file__).parent / "saes" / "smollm2-135m-instruct"  # runtime data: the server loads it


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/prismgate/saes``, else ``~/.cache/prismgate/saes``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prismgate" / "saes"


def recipe(dtype: str) -> str:
    """What names the cache folder besides the model: the recipe's version, the model's dtype, the text.

    The SAE's own settings (layer, width, k, epochs) are not in it: one SAE per layer lives
    under it, its settings in its cfg.json (:func:`train_settings`).
    """
    return f"prismgate.sae|recipe {RECIPE}|dtype {dtype}|corpus {corpus_digest(corpus())}"


def train_settings(config: TrainConfig) -> dict[str, object]:
    """The settings a trained SAE records (thread count aside: it changes the time, not the SAE's recipe)."""
    return {k: v for k, v in asdict(config).items() if k != "threads"}


def layer_dir(root: Path, layer: int) -> Path:
    return root / f"layer{layer}"


def cached_sae_root(cache_dir: str | Path | None, folder: str | Path, dtype: str) -> Path:
    """The folder under which ``prismgate sae train`` puts the SAEs of the model in ``folder``, one per layer."""
    folder = Path(folder).resolve()
    if not (folder / "config.json").exists():
        raise invalid(f"{folder}: not a Hugging Face model folder (no config.json)")
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return cache / model_digest(folder, recipe(dtype))


def sae_folders(root: Path) -> list[Path]:
    """The SAE folders (``layer<L>`` with a cfg.json) under ``root``, by layer."""
    found = [p for p in root.glob("layer*") if (p / CFG_FILE).is_file() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def auto_saes(cache_dir: str | Path | None, folder: str | Path, served_default: bool, dtype: str) -> list[Path]:
    """The folders ``sae = "auto"`` loads; refused, with the command that makes one, when there are none."""
    if served_default and sae_folders(SHIPPED):
        return sae_folders(SHIPPED)
    root = cached_sae_root(cache_dir, folder, dtype)
    found = sae_folders(root)
    if not found:
        raise invalid(
            f"sae = 'auto': no SAE trained for the model in {folder} (looked in {root}); "
            f"run 'prismgate sae train --model {folder}' first"
        )
    return found
