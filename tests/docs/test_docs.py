"""Every code block in README.md and docs/*.md runs against a real ``prismgate serve``.

Shell blocks run in bash (``set -euo pipefail``) from the repository root, Python blocks in the
test environment's interpreter, JSON blocks must parse, PromQL may name only metrics the server
exports, and Evergreen exchanges are replayed over a WebSocket. Examples say ``localhost:8000``
and ``:50051``: the test rewrites them to the server's free ports. A block that cannot run here
carries ``<!-- doc-test: skip: <reason> -->`` (see :mod:`tests.docs.markdown`); a block of any
other language must carry a marker, so nothing escapes unnoticed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.docs.evergreen import replay
from tests.docs.markdown import Block, blocks
from tests.docs.server import Served

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell"}
CHECKED = SHELL | {"python", "json", "promql"}
BLOCKS = [b for path in DOCS for b in blocks(path)]
ON_DEFAULT_MODEL = ("default-model", "evergreen")  # both quote the default model's answers
OUTPUTS = ("output", "output-also")
FIRST_EXAMPLES = ROOT / "README.md"  # its default-model answers are the fast tier's; the other pages' exhaustive


def _tier(block: Block) -> Any:
    slow = block.marker in ON_DEFAULT_MODEL and block.path != FIRST_EXAMPLES
    return pytest.param(block, marks=pytest.mark.slow) if slow else block


RUNNABLE = [_tier(b) for b in BLOCKS if b.marker not in OUTPUTS]


def _expected_outputs(block: Block) -> list[Block]:
    """The output the docs quote for ``block``, then what it prints on other kinds of CPU (``output-also``)."""
    following = [b for b in BLOCKS if b.path == block.path and b.line > block.line]
    if not following or following[0].marker != "output":
        return []
    outputs = [following[0]]
    for b in following[1:]:
        if b.marker != "output-also":
            break
        outputs.append(b)
    return outputs


def _on_ports(code: str, server: Served) -> str:
    code = re.sub(r"\b(localhost|127\.0\.0\.1):8000\b", rf"\1:{server.http_port}", code)
    return re.sub(r"\b(localhost|127\.0\.0\.1):50051\b", rf"\1:{server.grpc_port}", code)


def _env(tiny: tuple[Path, Path] | None) -> dict[str, str]:
    # the virtualenv's scripts come before the system's: grpcurl and websocat are the dev extras'
    path = [str(HERE / "bin"), str(Path(sys.executable).parent)]
    env = {
        **os.environ,
        "PATH": os.pathsep.join([*path, os.environ.get("PATH", "")]),
        "PYTHONPATH": str(ROOT),
        "DOC_TEST_PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PRISMGATE_THREADS": "1",
    }
    if tiny is not None:  # `prismgate generate` in a tiny block runs the tiny model too
        env.update(PRISMGATE_MODEL=str(tiny[0]), PRISMGATE_CONCEPT_PACK=str(tiny[1]))
    return env


DECIMAL = re.compile(r"[+-]?\d+\.\d+")


def matches(expected: str, actual: str) -> bool:
    """``actual`` is ``expected`` with each ``...`` standing for any text (whitespace runs compare equal).

    Decimal numbers (readouts, logprobs) may differ by a little (5% or 0.05): the last digits of a
    bfloat16 forward pass depend on the CPU's instruction set. Integers and text must be exact.
    """
    norm = " ".join(expected.split())
    numbers: list[float] = []
    pattern = ""
    for part in re.split(r"(\.\.\.|[+-]?\d+\.\d+|\s+)", norm):
        if part == "...":
            pattern += ".*?"
        elif DECIMAL.fullmatch(part):
            numbers.append(float(part))
            pattern += r"([+-]?\d+\.\d+)"
        elif part.isspace():
            pattern += r"\s*"
        else:
            pattern += re.escape(part)
    found = re.fullmatch(pattern, " ".join(actual.split()), flags=re.S)
    if found is None:
        return False
    return all(
        abs(float(got) - want) <= 0.05 + 0.05 * abs(want) for got, want in zip(found.groups(), numbers, strict=True)
    )


def test_every_block_is_run_or_says_why_not() -> None:
    for b in BLOCKS:
        if b.marker is None:
            assert b.lang in CHECKED, f"{b.name}: a ```{b.lang} block needs a doc-test marker (see tests/docs)"
        if b.marker == "output":
            before = [x for x in BLOCKS if x.path == b.path and x.line < b.line]
            assert before and before[-1].lang in SHELL | {"python"}, f"{b.name}: output of no runnable block"
        if b.marker == "output-also":
            before = [x for x in BLOCKS if x.path == b.path and x.line < b.line]
            assert before and before[-1].marker in OUTPUTS, f"{b.name}: output-also must follow an output block"


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_doc_block(block: Block, request: pytest.FixtureRequest) -> None:
    if block.marker == "skip":
        pytest.skip(f"{block.name} is not run: {block.reason}")
    on_default = block.marker in ON_DEFAULT_MODEL
    server: Served = request.getfixturevalue("default_docs_server" if on_default else "tiny_docs_server")
    tiny = None if on_default else (request.getfixturevalue("tiny_model_dir"), request.getfixturevalue("tiny_pack"))
    code = _on_ports(block.code, server)
    if block.marker == "evergreen":
        url = f"ws://127.0.0.1:{server.http_port}/evergreen"
        problems = asyncio.run(replay(url, code))
        assert not problems, f"{block.name}: the server's answer differs from the docs:\n" + "\n".join(problems)
        return
    if block.lang == "json":
        _parse_json(block)
        return
    if block.lang == "promql":
        exported = httpx.get(server.http_url + "/metrics").text
        for name in set(re.findall(r"\bprismgate_\w+", code)):
            assert re.search(rf"^{name}\b", exported, flags=re.M), f"{block.name}: {name} is not exported"
        return
    command = ["bash", "-euo", "pipefail", "-c", code] if block.lang in SHELL else [sys.executable, "-c", code]
    proc = subprocess.run(command, cwd=ROOT, env=_env(tiny), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{block.name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    expected = _expected_outputs(block)
    if expected:
        assert any(matches(e.code, proc.stdout) for e in expected), (
            f"{block.name}: the output differs from the docs ({', '.join(e.name for e in expected)}):\n{proc.stdout}"
        )


def _parse_json(block: Block) -> None:
    """One JSON value, or JSON lines."""
    try:
        json.loads(block.code)
        return
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(block.code.splitlines(), block.line + 1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                pytest.fail(f"{block.path.name}:{number}: not JSON ({exc})")


def test_matches_reads_dots_as_anything_and_decimals_loosely() -> None:
    assert matches('{"id": "...", "content": "Paris."}', '{"id": "chatcmpl-1",  "content": "Paris."}')
    assert not matches('{"content": "Paris."}', '{"content": "Lyon."}')
    assert matches("37 'The' -1.742 | -25.46", "37 'The' -1.739 | -25.52")
    assert not matches("37 'The' -1.742 | -25.46", "37 'The' -1.742 | -12.46")
    assert not matches("37 'The'", "38 'The'")
