"""The committed protobuf code is exactly what scripts/generate_schemas.py makes of schemas/*.proto today."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_schemas", ROOT / "scripts" / "generate_schemas.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_proto_has_generated_code_that_is_byte_identical(tmp_path: Path) -> None:
    script = _script()
    protos = script.proto_files()
    assert Path("salience.proto") in protos and Path("salience_images.proto") in protos
    fresh = script.generate(tmp_path)
    assert len(fresh) == 3 * len(protos)
    for rel in fresh:
        committed = script.SCHEMAS / rel
        assert committed.exists(), f"{rel} is not committed; run python scripts/generate_schemas.py"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} is out of date; run python scripts/generate_schemas.py"
        )
    leftovers = sorted(set(script.generated_files()) - set(fresh))
    assert not leftovers, f"generated files with no .proto: {leftovers}"


def test_generated_imports_use_the_package_name() -> None:
    script = _script()
    for rel in script.generated_files():
        text = (script.SCHEMAS / rel).read_text()
        for proto in script.proto_files():
            bare = proto.stem + "_pb2"
            assert f"\nimport {bare} " not in text, f"{rel} imports {bare} as a top-level module"


@pytest.mark.parametrize("proto", ["salience", "salience_images"])
def test_generated_modules_import_under_the_package(proto: str) -> None:
    pb2 = importlib.import_module(f"prismgate.schemas.{proto}_pb2")
    grpc_module = importlib.import_module(f"prismgate.schemas.{proto}_pb2_grpc")
    assert pb2.DESCRIPTOR.name == f"{proto}.proto"
    assert grpc_module.__name__.endswith("_pb2_grpc")


def test_the_rewrite_handles_plain_and_nested_imports() -> None:
    script = _script()
    modules = script._module_names([Path("a.proto"), Path("sub/b.proto")])
    text = "import a_pb2 as a__pb2\nfrom sub import b_pb2 as sub_dot_b__pb2\nimport grpc\nimport other_pb2 as o\n"
    assert script._rewrite_imports(text, modules) == (
        "from prismgate.schemas import a_pb2 as a__pb2\n"
        "from prismgate.schemas.sub import b_pb2 as sub_dot_b__pb2\n"
        "import grpc\nimport other_pb2 as o\n"
    )


def test_the_project_proto_keeps_the_spec_definitions(tmp_path: Path) -> None:
    """Only comments may differ from the spec: a client compiled from the spec must work unchanged."""
    # the shared specs folder sits beside the checkout (CI clones main next to it)
    spec = Path(__file__).resolve().parents[2] / "shared" / "specs" / "salience.proto"
    assert spec.exists(), f"the Salience spec is expected at {spec}"
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    def descriptor(path: Path, out: Path) -> descriptor_pb2.FileDescriptorSet:
        assert protoc.main(["protoc", f"-I{path.parent}", f"--descriptor_set_out={out}", str(path)]) == 0
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())

    ours = descriptor(ROOT / "schemas" / "salience.proto", tmp_path / "ours.pb")
    theirs = descriptor(spec, tmp_path / "theirs.pb")
    assert ours == theirs
