"""Regenerate the committed protobuf code from every ``schemas/**/*.proto``.

The generated modules are committed (the package installs without grpcio-tools), so this
script keeps them in step with the ``.proto`` files, and ``tests/test_schemas_current.py``
fails when they differ. It runs ``grpc_tools.protoc`` (include root ``schemas/``) and rewrites
protoc's top-level imports between generated modules to ``prismgate.schemas.…``.

Usage::

    python scripts/generate_schemas.py            # rewrite the files in schemas/
    python scripts/generate_schemas.py --check    # exit 1 if they are out of date
    python scripts/generate_schemas.py --out DIR  # write the tree into DIR instead
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "schemas"
PACKAGE = "prismgate.schemas"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(schema_dir: Path = SCHEMAS) -> list[Path]:
    """Every .proto under ``schema_dir``, as paths relative to it, in a stable order."""
    return sorted(p.relative_to(schema_dir) for p in schema_dir.rglob("*.proto"))


def outputs_for(proto: Path) -> list[Path]:
    """The generated files for one proto (relative to the schema folder)."""
    stem = proto.with_suffix("")
    return [stem.parent / (stem.name + suffix) for suffix in SUFFIXES]


def generated_files(schema_dir: Path = SCHEMAS) -> list[Path]:
    """Every generated-looking file under ``schema_dir`` (to catch leftovers of deleted protos)."""
    found = [p.relative_to(schema_dir) for s in SUFFIXES for p in schema_dir.rglob("*" + s)]
    return sorted(p for p in found if "__pycache__" not in p.parts)


def _module_names(protos: list[Path]) -> dict[str, str]:
    """Top-level module path protoc uses -> the importable name under ``prismgate.schemas``."""
    names: dict[str, str] = {}
    for proto in protos:
        parts = [*proto.parent.parts, proto.stem + "_pb2"]
        names[".".join(parts)] = ".".join([PACKAGE, *parts])
    return names


def _rewrite_imports(text: str, modules: dict[str, str]) -> str:
    """Point protoc's top-level imports of sibling generated modules at the package."""

    def plain(match: re.Match[str]) -> str:
        module, alias = match.group(1), match.group(2)
        target = modules.get(module)
        if target is None:
            return match.group(0)
        package, _, leaf = target.rpartition(".")
        return f"from {package} import {leaf} as {alias}"

    def from_import(match: re.Match[str]) -> str:
        package, leaf = match.group(1), match.group(2)
        target = modules.get(f"{package}.{leaf}")
        if target is None:
            return match.group(0)
        return f"from {target.rpartition('.')[0]} import {leaf}"

    text = re.sub(r"^import ([\w.]+_pb2) as (\w+)$", plain, text, flags=re.MULTILINE)
    return re.sub(r"^from ([\w.]+) import (\w+_pb2)\b", from_import, text, flags=re.MULTILINE)


def _protoc(schema_dir: Path, out_dir: Path, protos: list[Path]) -> None:
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{schema_dir}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in protos),
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed (exit {status}) on {', '.join(map(str, protos))}")


def generate(out_dir: Path, schema_dir: Path = SCHEMAS) -> list[Path]:
    """Write the generated code for every proto in ``schema_dir`` into ``out_dir``; return the files."""
    protos = proto_files(schema_dir)
    if not protos:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    _protoc(schema_dir, out_dir, protos)
    modules = _module_names(protos)
    written = []
    for proto in protos:
        for rel in outputs_for(proto):
            path = out_dir / rel
            if not path.exists():
                raise RuntimeError(f"protoc did not write {rel}")
            path.write_text(_rewrite_imports(path.read_text(encoding="utf-8"), modules), encoding="utf-8")
            written.append(rel)
    return written


def stale(schema_dir: Path = SCHEMAS) -> list[str]:
    """What differs between the committed generated files and a fresh generation (empty: current)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp), schema_dir)
        problems = []
        for rel in fresh:
            committed = schema_dir / rel
            if not committed.exists():
                problems.append(f"{rel}: missing")
            elif not filecmp.cmp(committed, Path(tmp) / rel, shallow=False):
                problems.append(f"{rel}: differs")
        for rel in sorted(set(generated_files(schema_dir)) - set(fresh)):
            problems.append(f"{rel}: generated file with no .proto")
        return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report whether the committed files are current")
    parser.add_argument("--out", type=Path, help="write into this folder instead of schemas/")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python scripts/generate_schemas.py", file=sys.stderr)
        return 1 if problems else 0
    for rel in generate(args.out or SCHEMAS):
        print(rel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
