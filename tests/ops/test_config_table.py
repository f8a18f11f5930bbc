"""The committed configuration table is the one the Settings dataclass generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prismgate.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_committed_table_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_table.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr + "\n(regenerate with: python scripts/config_table.py)"


def test_every_setting_has_a_row() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for field in Settings.fields():
        assert f"| `--{field.name.replace('_', '-')}` | `PRISMGATE_{field.name.upper()}` | `{field.name}` |" in doc


def test_check_fails_on_a_stale_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import config_table
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    stale = tmp_path / "configuration.md"
    stale.write_text("| old table |\n")
    monkeypatch.setattr(config_table, "TARGET", stale)
    assert config_table.main(["--check"]) == 1
    assert config_table.main([]) == 0
    assert config_table.main(["--check"]) == 0
    assert "`PRISMGATE_SHUTDOWN_GRACE_S`" in stale.read_text()
