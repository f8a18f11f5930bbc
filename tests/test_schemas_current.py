"""The committed protobuf code is exactly what scripts/generate_schemas.py makes of schemas/*.proto today."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "salience_v1.descriptor.json"


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
    """Only comments may differ from the seed's salience.v1: a client compiled from the spec must work unchanged.

    ``tests/golden/salience_v1.descriptor.json`` is the seed proto's FileDescriptorSet as
    protoc makes it (no source info, so no comments), written once as proto3 JSON and
    never regenerated from the project's proto: salience.v1 is frozen.
    """
    from google.protobuf import descriptor_pb2, json_format
    from grpc_tools import protoc

    out = tmp_path / "ours.pb"
    proto = ROOT / "schemas" / "salience.proto"
    assert protoc.main(["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", str(proto)]) == 0
    ours = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    golden = json_format.Parse(GOLDEN.read_text(), descriptor_pb2.FileDescriptorSet())
    assert [f.package for f in golden.file] == ["salience.v1"]
    assert json_format.MessageToDict(ours) == json_format.MessageToDict(golden)
