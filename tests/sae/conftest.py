"""The SAE tests' servers: the tiny model with two random TopK SAEs (after layers 0 and 1, labels on the first)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveServer, run_server, tiny_settings
from tests.sae.saes import write_sae


@pytest.fixture(scope="module")
def saes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("saes")
    a = write_sae(root / "a", layer=0, k=6, seed=5)
    (a / "labels.json").write_text(json.dumps({str(i): f"feature {i}" for i in range(0, 256, 2)}))
    return [a, write_sae(root / "b", layer=1, k=6, seed=6)]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_pack: Path, saes: list[Path]) -> Iterator[LiveServer]:
    with run_server(tiny_settings(tiny_model_dir, tiny_pack, sae=",".join(map(str, saes)))) as srv:
        yield srv
