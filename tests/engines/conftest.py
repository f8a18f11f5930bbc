"""The engines every conformance test runs against.

``PRISMGATE_TEST_ENGINES`` (comma-separated) picks them: ``transformers`` by default; the
vLLM stage of CI runs the same suite with ``vllm`` inside its own virtualenv.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio


def engine_names() -> list[str]:
    return [n.strip() for n in os.environ.get("PRISMGATE_TEST_ENGINES", "transformers").split(",") if n.strip()]


def make_engine(name: str, model_dir: Path, pack: Path | None, model_id: str = "tiny-llama") -> Any:
    if name == "transformers":
        from prismgate.engines.hf import TransformersEngine

        return TransformersEngine(model_dir, model_id=model_id, concept_pack=pack, threads=1, prefill_chunk=16)
    if name == "vllm":
        from tests.engines.vllm_factory import make_vllm_engine

        return make_vllm_engine(model_dir, model_id=model_id, concept_pack=pack)
    raise ValueError(f"unknown engine {name!r}")


@pytest.fixture(scope="session", params=engine_names())
def engine_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def engine_factory(engine_name: str) -> Callable[..., Any]:
    return lambda model_dir, pack=None, **kw: make_engine(engine_name, model_dir, pack, **kw)


def with_eos(model_dir: Path, target: Path, eos_id: int) -> Path:
    """A copy of a model folder whose generation config names ``eos_id`` as EOS."""
    shutil.copytree(model_dir, target)
    for name in ("generation_config.json", "config.json"):
        path = target / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = eos_id
        path.write_text(json.dumps(data))
    return target


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tiny_pair(tiny_model_dir: Path, tiny_pack: Path) -> Any:
    """The transformers and vLLM engines on the tiny model, float32, for the module's cross-checks."""
    from tests.engines.test_vllm_crosscheck import pair

    hf, vl = await pair(tiny_model_dir, tiny_pack, "tiny-llama")
    yield hf, vl
    await vl.close()
    await hf.close()
