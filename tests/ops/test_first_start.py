"""The first start of the default model, as a new user sees it: the ports first, then the GGUF
conversion (once), then ``ready``; and no library noise (progress bars, warnings) in the log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve_process import serve_process


@pytest.mark.slow
def test_the_first_start_logs_the_ports_before_converting_and_nothing_but_log_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRISMGATE_CACHE_DIR", str(tmp_path / "cache"))  # nothing converted yet
    (tmp_path / "run").mkdir()
    with serve_process(tmp_path / "run") as served:
        lines = served.log_lines()
    messages = [line["message"] for line in served.logs()]
    assert len(messages) == len(lines), "every line is a JSON log record: no progress bars, no warnings' text"
    ports = next(i for i, m in enumerate(messages) if m.startswith("HTTP on"))
    converting = next(i for i, m in enumerate(messages) if m.startswith("converting SmolLM2-135M-Instruct from GGUF"))
    ready = next(i for i, m in enumerate(messages) if m.startswith("ready:"))
    assert ports < converting < ready
    assert (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct-bf16" / "model.safetensors").exists()
