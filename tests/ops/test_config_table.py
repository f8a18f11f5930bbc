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


def test_each_group_is_one_table_under_its_own_heading() -> None:
    """The tables follow the groups: every setting sits under its group's heading, and nowhere else."""
    from prismgate.settings.flags import sections

    doc = (ROOT / "docs" / "configuration.md").read_text()
    parts = doc.split("\n### ")[1:]
    assert len(parts) == len(sections()) > 10
    for part, (title, specs) in zip(parts, sections(), strict=True):
        assert part.startswith(title[:1].upper() + title[1:] + "\n")
        rows = [line.split(" | ")[0].strip("| `") for line in part.splitlines() if line.startswith("| `--")]
        assert rows == [spec.flag for spec in specs]


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
