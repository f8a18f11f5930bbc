"""The runtime loads no instrument unless a start asks for an ``auto`` pack (docs/architecture.md, "Instruments").

The import contracts (``make lint``) pin the static imports; this checks the lazy ones the
composition root makes, in a fresh interpreter, as a start runs them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STARTS = """
import sys
from pathlib import Path

import prismgate.server
from prismgate.compose import build_engine
from tests.conftest import tiny_settings

model, pack, cache = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
for overrides in ({}, {"concept_pack": "auto", "concept_pack_cache": cache}):
    engine = build_engine(tiny_settings(model, pack, **overrides))
    loaded = sorted(m for m in sys.modules if m.startswith("prismgate.instruments"))
    print(type(engine).__name__, ",".join(loaded) or "-")
"""


def test_only_an_auto_pack_loads_instruments(tiny_model_dir: Path, tiny_pack: Path, tmp_path: Path) -> None:
    # one interpreter, named pack first: what the first start loads is all a server with its pack named loads
    proc = subprocess.run(
        [sys.executable, "-c", STARTS, str(tiny_model_dir), str(tiny_pack), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (named, named_loaded), (auto, auto_loaded) = (line.split() for line in proc.stdout.splitlines())
    assert named == "TransformersEngine"
    assert named_loaded == "-", f"a start with its pack named imported instruments: {named_loaded}"
    assert auto == "PreparedEngine", "the auto pack's build runs as a preparation step in front of the serving engine"
    assert "prismgate.instruments.packs.auto" in auto_loaded.split(",")
