"""The concept-pack file: round trips with and without centers, reproducible bytes, older packs, bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from prismgate.core.errors import GatewayError
from prismgate.engines.readouts.pack import FORMAT, LAYER_CONVENTION, ConceptPack, SteeringRange
from prismgate.instruments.packs.cli import main
from prismgate.instruments.packs.show import describe

LAYERS = (2, 5)
CONCEPTS = ("alpha", "beta", "gamma")


def _directions(hidden: int = 16, seed: int = 0) -> np.ndarray:
    d = np.random.default_rng(seed).standard_normal((len(LAYERS), len(CONCEPTS), hidden)).astype(np.float32)
    return d / np.linalg.norm(d, axis=-1, keepdims=True)


def _centers() -> np.ndarray:
    return np.array([[-40.25, 0.5, 25.0], [1.5, -2.75, 1e-3]], dtype=np.float32)


def _pack(centers: np.ndarray | None) -> ConceptPack:
    return ConceptPack(
        directions=_directions(),
        layers=LAYERS,
        concepts=CONCEPTS,
        model_id="m",
        method="test",
        descriptions={"alpha": "a", "beta": "b", "gamma": "g"},
        centers=centers,
    )


def test_round_trip_with_centers(tmp_path: Path) -> None:
    pack = _pack(_centers())
    path = tmp_path / "p.safetensors"
    pack.save(path)
    again = ConceptPack.load(path)
    assert again.centers is not None and again.centers.dtype == np.float32
    assert again.centers.tobytes() == _centers().tobytes()
    assert again.directions.tobytes() == pack.directions.tobytes()
    assert (again.layers, again.concepts, again.descriptions) == (LAYERS, CONCEPTS, pack.descriptions)
    manifest = again.manifest
    assert manifest.centers == tuple(tuple(float(v) for v in row) for row in _centers())
    assert len(manifest.centers) == len(LAYERS) and len(manifest.centers[0]) == len(CONCEPTS)
    assert describe(again)["centers"] == _centers().tolist()


def test_round_trip_without_centers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.safetensors"
    _pack(None).save(path)
    again = ConceptPack.load(path)
    assert again.centers is None and again.manifest.centers is None
    assert describe(again)["centers"] is None
    assert list(load_file(str(path))) == ["directions"]
    assert describe(again)["scales"] is None
    assert main(["show", str(path)]) == 0
    summary = capsys.readouterr().out
    assert "centers    none" in summary and "scales     none" in summary


def test_the_file_is_standard_safetensors_and_reproducible(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _pack(_centers()).save(a)
    _pack(_centers().copy()).save(b)
    assert a.read_bytes() == b.read_bytes()
    # safetensors' own reader agrees on both tensors, their shapes and the metadata.
    tensors = load_file(str(a))
    assert sorted(tensors) == ["centers", "directions"]
    assert tensors["centers"].shape == (2, 3) and tensors["directions"].shape == (2, 3, 16)
    np.testing.assert_array_equal(tensors["directions"], _directions())
    with safe_open(str(a), framework="numpy") as f:
        assert f.metadata()["format"] == FORMAT
    # The layout: header offsets per tensor, in name order, data back to back with no gap.
    raw = a.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    assert header["centers"]["data_offsets"] == [0, 2 * 3 * 4]
    assert header["directions"]["data_offsets"] == [24, 24 + 2 * 3 * 16 * 4]
    assert len(raw) == 8 + size + 24 + 2 * 3 * 16 * 4 and size % 8 == 0
    # Centers change the file; a pack without them gives other bytes than one with.
    _pack(None).save(b)
    assert a.read_bytes() != b.read_bytes()


def test_an_older_pack_without_centers_still_loads(tmp_path: Path) -> None:
    """A pack as written before centers existed (here by safetensors' own writer): one tensor, same metadata."""
    path = tmp_path / "old.safetensors"
    metadata = {
        "format": FORMAT,
        "model_id": "m",
        "layers": json.dumps(list(LAYERS)),
        "concepts": json.dumps(list(CONCEPTS)),
        "hidden_size": "16",
        "layer_convention": LAYER_CONVENTION,
        "method": "older",
        "descriptions": "{}",
    }
    save_file({"directions": _directions()}, str(path), metadata=metadata)
    pack = ConceptPack.load(path)
    assert pack.centers is None and pack.manifest.centers is None
    assert pack.method == "older" and pack.concepts == CONCEPTS
    np.testing.assert_array_equal(pack.directions, _directions())


def test_bad_centers_are_refused() -> None:
    with pytest.raises(GatewayError, match=r"centers have shape \(3, 2\)"):
        _pack(_centers().T.copy())
    with pytest.raises(GatewayError, match="finite"):
        _pack(np.array([[0.0, np.nan, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32))


def test_scales_round_trip_in_name_order(tmp_path: Path) -> None:
    scales = np.array([[9.5, 0.25, 3.0], [17.0, 4.5, 0.125]], dtype=np.float32)
    path = tmp_path / "p.safetensors"
    dataclasses.replace(_pack(_centers()), scales=scales).save(path)
    again = ConceptPack.load(path)
    assert again.scales is not None and again.scales.tobytes() == scales.tobytes()
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == ["centers", "directions", "scales"]
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert header["scales"]["data_offsets"][0] == header["directions"]["data_offsets"][1]  # after directions
    # without scales, a pack's bytes are what they were before scales existed
    without = tmp_path / "q.safetensors"
    _pack(_centers()).save(without)
    assert ConceptPack.load(without).scales is None
    assert b"scales" not in without.read_bytes()


def test_bad_scales_are_refused() -> None:
    for bad, message in (
        (np.ones((3, 2), dtype=np.float32), r"scales have shape \(3, 2\)"),
        (np.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=np.float32), "above zero"),
        (np.array([[1.0, np.inf, 1.0], [1.0, 1.0, 1.0]], dtype=np.float32), "finite"),
    ):
        with pytest.raises(GatewayError, match=message):
            dataclasses.replace(_pack(_centers()), scales=bad)


STEERING = {
    "alpha": SteeringRange(layer=5, scale=16.0, range=32.0, effect=1.25),
    "gamma": SteeringRange(2, 8.0, 8.0, -0.5),
}


def test_measured_steering_round_trips_and_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "p.safetensors"
    dataclasses.replace(_pack(_centers()), steering=STEERING).save(path)
    again = ConceptPack.load(path)
    assert again.steering == STEERING
    with safe_open(str(path), framework="numpy") as f:
        stored = json.loads((f.metadata() or {})["steering"])
    assert stored["alpha"] == {"layer": 5, "scale": 16.0, "range": 32.0, "effect": 1.25}
    assert describe(again)["steering"] == {c: r.to_json() for c, r in STEERING.items()}
    assert main(["show", str(path)]) == 0
    table = capsys.readouterr().out.split("\nsteering")[1].split("\nmethod")[0].splitlines()
    assert table[1].split() == ["layer", "scale", "range", "effect"]
    rows = {line.split()[0]: line.split()[1:] for line in table[2:]}
    assert rows == {
        "alpha": ["L5", "+16", "32", "+1.25"],
        "beta": ["never", "fluent", "at", "the", "smallest", "scale", "measured"],
        "gamma": ["L2", "+8", "8", "-0.50"],
    }


def test_a_pack_without_measured_steering_loads_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain, measured = tmp_path / "plain.safetensors", tmp_path / "measured.safetensors"
    _pack(_centers()).save(plain)
    dataclasses.replace(_pack(_centers()), steering=STEERING).save(measured)
    again = ConceptPack.load(plain)
    assert again.steering is None and describe(again)["steering"] is None
    with safe_open(str(plain), framework="numpy") as f:
        assert "steering" not in (f.metadata() or {})  # the bytes of a pack from before steering was measured
    assert plain.read_bytes() != measured.read_bytes()
    assert main(["show", str(plain)]) == 0
    assert "steering   not measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("steering", "message"),
    [
        ({"delta": SteeringRange(2, 8.0, 8.0, 1.0)}, "not in the pack"),
        ({"alpha": SteeringRange(3, 8.0, 8.0, 1.0)}, "not in the pack"),
        ({"alpha": SteeringRange(2, 16.0, 8.0, 1.0)}, "0 < scale <= range"),
        ({"alpha": SteeringRange(2, 0.0, 8.0, 1.0)}, "0 < scale <= range"),
    ],
)
def test_bad_steering_is_refused(steering: dict[str, SteeringRange], message: str) -> None:
    with pytest.raises(GatewayError, match=message):
        dataclasses.replace(_pack(None), steering=steering)


def test_malformed_steering_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.safetensors"
    meta = {
        "format": FORMAT,
        "layer_convention": LAYER_CONVENTION,
        "layers": "[2, 5]",
        "concepts": json.dumps(CONCEPTS),
    }
    save_file({"directions": _directions()}, str(path), metadata={**meta, "steering": '{"alpha": {"layer": 2}}'})
    with pytest.raises(GatewayError, match="steering metadata is malformed"):
        ConceptPack.load(path)
