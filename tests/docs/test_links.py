"""The README stays short, and every relative link in it and in docs/ leads somewhere.

A link names a file of the repository (relative to the page) and, for a Markdown page, maybe a
heading's anchor, spelled as GitHub spells it. Links inside code (fenced or inline) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.markdown import FENCE

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12_000  # characters: a page a newcomer reads in five minutes, then follows links
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<title>.+?)\s*#*\s*$")


def prose(text: str) -> list[tuple[int, str]]:
    """The numbered lines of ``text`` outside fenced code blocks."""
    lines: list[tuple[int, str]] = []
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (not fence or (m["fence"].startswith(fence[0]) and len(m["fence"]) >= len(fence))):
            fence = "" if fence else m["fence"]
            continue
        if not fence:
            lines.append((number, line))
    return lines


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in prose(path.read_text()):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading["title"])
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or anchor does not exist, as ``page:line: target``."""
    broken = []
    for number, line in prose(page.read_text()):
        for m in LINK.finditer(re.sub(r"`+[^`]*`+", "``", line)):  # inline code holds no links
            target = m["target"]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                broken.append(f"{page.name}:{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}:{number}: {target} (no such heading)")
    return broken


def test_readme_fits_in_its_budget() -> None:
    size = len(README.read_text())
    assert size <= README_LIMIT, f"README.md is {size} characters (at most {README_LIMIT}): move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_lead_somewhere(page: Path) -> None:
    assert not broken_links(page)


def test_broken_links_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Its `--flag` (and more)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#its---flag-and-more) [ok](#page) [web](https://example.org/x)\n"
        "[gone](missing.md) [no heading](other.md#nothing) ![img](nope.png)\n"
        "`[in code](missing.md)`\n```sh\n[fenced](missing.md)\n```\n[after](gone.md)\n"
    )
    assert broken_links(page) == [
        "page.md:4: missing.md (no such file)",
        "page.md:4: other.md#nothing (no such heading)",
        "page.md:4: nope.png (no such file)",
        "page.md:9: gone.md (no such file)",
    ]
