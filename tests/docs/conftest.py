"""Two real servers for the doc tests: the tiny test model (fast) and the real default model.

The tiny one is served under the default model's name, so examples run unchanged against it;
blocks whose quoted output only the real model gives are marked ``default-model``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prismgate.engines.models import DEFAULT_MODEL_ID
from tests.docs.server import Served, serve


@pytest.fixture(scope="session")
def tiny_docs_server(
    tiny_model_dir: Path, tiny_pack: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    args = ("--model", str(tiny_model_dir), "--model-name", DEFAULT_MODEL_ID, "--concept-pack", str(tiny_pack))
    with serve(tmp_path_factory.mktemp("docs-tiny"), *args) as served:
        yield served


@pytest.fixture(scope="session")
def default_docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(tmp_path_factory.mktemp("docs-default"), "--sae", "auto") as served:  # docs/sae.md reads features
        yield served
