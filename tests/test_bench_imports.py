"""Every import of the project in bench/, also those inside functions, names something that exists.

A benchmark imports lazily what only one of its modes needs, so a module that moves breaks a
mode nobody ran since (``bench/vs_vllm.py --sae`` imported an SAE module from where it had lived).
Modules of the vLLM engine are checked only where vLLM is installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def project_imports() -> list[tuple[str, int, str, tuple[str, ...]]]:
    found = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("prismgate", "bench"):
                found.append((path.name, node.lineno, node.module, tuple(a.name for a in node.names)))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ("prismgate", "bench"):
                        found.append((path.name, node.lineno, alias.name, ()))
    return found


@pytest.mark.parametrize("where, line, module, names", project_imports(), ids=lambda v: str(v))
def test_the_import_resolves(where: str, line: int, module: str, names: tuple[str, ...]) -> None:
    if module.startswith("prismgate.engines.vllm") and importlib.util.find_spec("vllm") is None:
        pytest.skip("the vLLM engine's modules import vllm: checked in .venv-vllm")
    imported = importlib.import_module(module)
    for name in names:
        assert hasattr(imported, name) or importlib.util.find_spec(f"{module}.{name}") is not None, (
            f"bench/{where}:{line}: {module} has no {name}"
        )
