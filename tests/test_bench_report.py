"""bench/report.py rewrites only the sections of docs/benchmarks.md that it writes."""

from __future__ import annotations

from bench.report import DOC, merge, sections


def test_written_sections_replace_their_namesakes_and_hand_written_ones_stay() -> None:
    old = "## Benchmarks\n\nold intro\n\n### A\n\nold a\n\n### By hand\n\nkept, word for word\n\n### B\n\nold b\n"
    new = "## Benchmarks\n\nnew intro\n\n### B\n\nnew b\n\n### A\n\nnew a\n\n### C\n\nnew c\n"
    merged = merge(old, new)
    assert merged == (
        "## Benchmarks\n\nnew intro\n\n### A\n\nnew a\n\n### By hand\n\nkept, word for word\n\n"
        "### B\n\nnew b\n\n### C\n\nnew c\n"
    )
    assert merge(merged, new) == merged  # a second run changes nothing


def test_the_committed_page_cuts_into_sections_and_back() -> None:
    text = DOC.read_text()
    head, parts = sections(text)
    assert head.startswith("## Benchmarks")
    assert "### SAE features" in parts
    assert merge(text, head) == text  # nothing written: every section stays, in its place
