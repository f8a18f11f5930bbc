"""The fenced code blocks of a Markdown file, with the doc-test marker written above each.

A marker is an HTML comment on the line right above a fence (GitHub does not render it)::

    <!-- doc-test: skip: starts Docker, which the test machines do not have -->
    <!-- doc-test: default-model -->          run against the real default model (its output is quoted)
    <!-- doc-test: output -->                 the stdout the block above prints ("..." matches anything)
    <!-- doc-test: output-also: CPU -->       what it prints instead on another kind of CPU, which the
                                              reason names (bfloat16's last bits depend on the kernels
                                              a CPU's instruction set selects, and near-ties can flip)
    <!-- doc-test: evergreen -->              a WebSocket exchange with the default model: "> " lines
                                              are sent, "< " lines received

A skip must give its reason. Blocks without a marker run against the tiny test model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*(?P<kind>[a-z-]+)\s*(?::\s*(?P<reason>.*?))?\s*-->\s*$")
KINDS = {"skip", "default-model", "output", "output-also", "evergreen"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None = None  # one of KINDS
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order. A malformed marker is an error, not a silent skip."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].lstrip().startswith("<!--") and "doc-test" in lines[i] and not MARKER.match(lines[i]):
                raise ValueError(f"{path.name}:{i + 1}: malformed doc-test marker: {lines[i]!r}")
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:])
            j += 1
        if j == len(lines):
            raise ValueError(f"{path.name}:{i + 1}: unclosed code fence")
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        kind, reason = (marker["kind"], marker["reason"] or "") if marker else (None, "")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"{path.name}:{i}: unknown doc-test marker {kind!r} (known: {sorted(KINDS)})")
        if kind in ("skip", "output-also") and not reason:
            raise ValueError(f"{path.name}:{i}: a doc-test {kind} needs its reason")
        lang = m["info"].strip().split()[0] if m["info"].strip() else ""
        found.append(Block(path, i + 1, lang, "\n".join(body) + "\n", kind, reason))
        i = j + 1
    return found
