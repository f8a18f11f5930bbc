"""The committed GraphPipe code is exactly what flatc makes of schemas/graphpipe.fbs today."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_flatbuffers", ROOT / "scripts" / "generate_flatbuffers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_graphpipe_code_is_current(tmp_path: Path) -> None:
    script = _script()
    flatc = script.find_flatc()  # flatc is a dev dependency: missing it is a failure, not a skip
    fresh = tmp_path / "fb"
    script.generate(fresh, flatc)
    committed = _files(script.OUT)
    regenerated = _files(fresh)
    assert sorted(committed) == sorted(regenerated), "run: python scripts/generate_flatbuffers.py"
    for name, data in regenerated.items():
        assert committed[name] == data, f"{name} is stale: run python scripts/generate_flatbuffers.py"


def test_generated_code_matches_the_wire_facts() -> None:
    from prismgate.schemas.graphpipe.fb import graphpipe_generated as gp

    assert (gp.Type.Null, gp.Type.Int32, gp.Type.Float32, gp.Type.String) == (0, 6, 10, 12)
    assert (gp.Req.NONE, gp.Req.InferRequest, gp.Req.MetadataRequest) == (0, 1, 2)
