"""The SAE tests' servers: the tiny model with two random TopK SAEs (after layers 0 and 1, labels on the first)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveServer, run_server, tiny_settings
from tests.sae.saes import labelled_pair


@pytest.fixture(scope="module")
def saes(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return labelled_pair(tmp_path_factory.mktemp("saes"))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_pack: Path, saes: list[Path]) -> Iterator[LiveServer]:
    with run_server(tiny_settings(tiny_model_dir, tiny_pack, sae=",".join(map(str, saes)))) as srv:
        yield srv
