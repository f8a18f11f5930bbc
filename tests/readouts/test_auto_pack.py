"""``--concept-pack auto``: a model without a pack gets one built on first start, cached by digest, then reused."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from prismgate.compose import concept_pack_for
from prismgate.core.errors import GatewayError
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.instruments.packs.auto import cached_pack_path, pack_digest, select_layers
from prismgate.instruments.packs.prompt_sets import load_prompt_sets
from prismgate.instruments.packs.report import Separation, SeparationReport
from prismgate.server import Gateway
from tests.conftest import TINY_MODEL_ID, run_server, tiny_settings
from tests.tiny_model import build_tiny_llama

pytestmark = pytest.mark.slow

PAIRS = 4  # small: the tiny model's build then takes well under a second


def auto_settings(model_dir: Path, cache: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {"concept_pack": "auto", "concept_pack_cache": str(cache), "concept_pack_pairs": PAIRS}
    return tiny_settings(model_dir, Path("unused"), **(values | overrides))


def readouts_of(server: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": "Bonjour, comment allez-vous ?"}],
        "max_tokens": 4,
        "temperature": 0,
        "readouts": True,
    }
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    model = httpx.get(f"{server.http_url}/v1/models/{TINY_MODEL_ID}", timeout=10).json()
    return model["prismgate"]["readouts"], r.json()["choices"][0]["prismgate"]["readouts"]


def test_first_start_builds_second_start_reuses(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "packs"
    settings = auto_settings(tiny_model_dir, cache)
    expected = cached_pack_path(cache, tiny_model_dir, pairs=PAIRS, dtype="auto")
    assert concept_pack_for(settings, served_default=False) == expected and not expected.exists()

    with caplog.at_level(logging.INFO, logger="prismgate.readouts"), run_server(settings) as server:
        manifest, entries = readouts_of(server)
        playground = httpx.get(f"{server.http_url}/playground/manifest.json", timeout=10).json()
    assert [p.name for p in cache.iterdir()] == [expected.name], "one pack, named by the digest; no partial files"
    pack = ConceptPack.load(expected)
    names = sorted(s.name for s in load_prompt_sets([Path(pack_module_dir(), "prompt_sets")]))
    assert list(pack.concepts) == names == manifest["concepts"]
    assert manifest["layers"] == list(pack.layers) and set(pack.layers) <= {0, 1, 2}
    assert "separation report" in pack.method and pack.scales is not None and pack.model_id == TINY_MODEL_ID
    scales = playground["readouts"]["scales"]
    assert scales is not None, "the playground's fixed colour scale comes from the built pack"
    assert np.allclose(scales, pack.scales)
    assert entries and all(len(e["values"]) == len(pack.layers) for e in entries)
    assert all(len(row) == len(names) for e in entries for row in e["values"])
    built = [r.getMessage() for r in caplog.records if "concept pack: built" in r.getMessage()]
    assert len(built) == 1 and " s (model load " in built[0]
    assert any("pass 2/2: batch" in r.getMessage() for r in caplog.records), "progress is logged"
    # where each concept steers was measured too (the random tiny model may steer nothing fluently: then {}),
    # and the playground starts from it
    assert pack.steering is not None and "steering: per concept" in pack.method
    assert "steering measured in" in built[0]
    assert playground["readouts"]["steering"]["concepts"] == {c: r.to_json() for c, r in pack.steering.items()}

    mtime = expected.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="prismgate.readouts"), run_server(settings) as server:
        again, _ = readouts_of(server)
    assert again == manifest
    assert expected.stat().st_mtime_ns == mtime
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("concept pack: reusing") for m in messages)
    assert not any("building" in m or "built" in m for m in messages)


def pack_module_dir() -> Path:
    from prismgate.instruments.packs import build

    return Path(build.__file__).parent


def test_digest_names_the_model_and_the_recipe(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_llama(tmp_path / "other", seed=1)
    same = build_tiny_llama(tmp_path / "same", seed=0)
    base = pack_digest(tiny_model_dir, pairs=PAIRS, dtype="auto")
    assert pack_digest(other, pairs=PAIRS, dtype="auto") != base, "different weights, different digest"
    assert pack_digest(same, pairs=PAIRS, dtype="auto") == base, "same files elsewhere: the same pack"
    assert pack_digest(tiny_model_dir, pairs=PAIRS + 1, dtype="auto") != base
    assert pack_digest(tiny_model_dir, pairs=PAIRS, dtype="float32") != base
    with pytest.raises(GatewayError, match=r"concept_pack_pairs must be >= 2"):
        pack_digest(tiny_model_dir, pairs=1, dtype="auto")
    with pytest.raises(GatewayError, match=r"no config\.json"):
        pack_digest(tmp_path, pairs=PAIRS, dtype="auto")


def test_readyz_says_building_while_the_loop_keeps_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    # 40 pairs (every prompt): the build lasts long enough to be watched from the loop.
    settings = auto_settings(tiny_model_dir, tmp_path / "packs", concept_pack_pairs=40)

    async def watch() -> tuple[list[tuple[int, dict[str, Any]]], float]:
        gateway = Gateway(settings)
        await gateway.start()
        seen: list[tuple[int, dict[str, Any]]] = []
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.http_port}") as client:
                started = time.perf_counter()
                while True:
                    r = await client.get("/readyz", timeout=5)
                    seen.append((r.status_code, r.json()))
                    if r.status_code == 200:
                        return seen, time.perf_counter() - started
                    assert time.perf_counter() - started < 120
                    await asyncio.sleep(0.02)
        finally:
            await gateway.stop()

    seen, seconds = asyncio.run(watch())
    building = [body for status, body in seen if status == 503 and body["reason"].startswith("building concept pack")]
    assert building, f"/readyz never said it was building: {json.dumps(seen[:3])}"
    assert all(body["state"] == "loading" for body in building)
    assert len(building) >= 5, f"/readyz answered only {len(building)} times in a {seconds:.1f} s build"


def test_a_failed_build_serves_without_readouts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = build_tiny_llama(tmp_path / TINY_MODEL_ID)
    cache = tmp_path / "not-a-folder"
    cache.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.INFO, logger="prismgate.readouts"), run_server(auto_settings(model, cache)) as server:
        info = httpx.get(f"{server.http_url}/v1/models/{TINY_MODEL_ID}", timeout=10).json()
    assert info["prismgate"].get("readouts") is None
    assert any("the build failed" in r.getMessage() and "without readouts" in r.getMessage() for r in caplog.records)


def test_layers_follow_the_report() -> None:
    accuracy = {0: 0.60, 1: 0.70, 2: 0.80, 3: 0.88, 4: 0.89, 5: 0.87, 6: 0.95}

    def row(concept: str, layer: int) -> Separation:
        return Separation(concept, layer, 1.0, 3.0, accuracy[layer], 8, 80)

    report = SeparationReport(folds=4, rows=tuple(row(c, x) for c in ("a", "b") for x in accuracy))
    layers, note = select_layers(report, n_layers=7, count=2)
    assert layers == (3, 5), "the plateau (within 0.03 of the best, last layer excluded), spread out"
    assert "L3 0.88" in note and "best 0.89" in note
    layers, _ = select_layers(report, n_layers=7, count=5)
    assert layers == (1, 2, 3, 4, 5), "a short plateau is topped up with the next best layers"


def test_the_gpu_profile_keeps_built_packs_on_a_volume() -> None:
    import yaml

    root = Path(__file__).resolve().parents[2]
    compose = yaml.safe_load((root / "docker-compose.yml").read_text())
    gpu = compose["services"]["gateway-gpu"]
    assert "PRISMGATE_CONCEPT_PACK" not in gpu["environment"], "no pack named: the GPU model gets 'auto'"
    cache = gpu["environment"]["PRISMGATE_CONCEPT_PACK_CACHE"]
    (mount,) = [v for v in gpu["volumes"] if v["target"] == cache]
    assert mount["type"] == "volume" and mount["source"] in compose["volumes"] and not mount.get("read_only")
    # A named volume takes its owner from the image's folder: the image must create it for its user.
    dockerfile = (root / "Dockerfile.gpu").read_text()
    assert (
        f"mkdir -p /models {cache}" in dockerfile
        and "chown -R prismgate:prismgate /home/prismgate/.cache" in dockerfile
    )
    assert "USER 10001:10001" in dockerfile


async def test_stopped_while_building_never_loads_the_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from prismgate.core.health import STOPPING
    from prismgate.engines.hf import TransformersEngine
    from prismgate.engines.prepare import PreparedEngine
    from prismgate.instruments.packs.auto import pack_step

    made: list[Path | None] = []

    def make(pack: Path | None) -> TransformersEngine:
        made.append(pack)
        return TransformersEngine(tiny_model_dir, model_id=TINY_MODEL_ID, concept_pack=pack, threads=1)

    path = tmp_path / "pack.safetensors"
    step = pack_step(tiny_model_dir, path, model_id=TINY_MODEL_ID, pairs=40)
    engine = PreparedEngine(make, [step], model_id=TINY_MODEL_ID, pack=None)
    starting = asyncio.create_task(engine.start())
    for _ in range(6000):  # polled: the build reports through health(), as /readyz reads it
        if engine.health().reason.startswith("building concept pack"):
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the build never reported itself in health()")
    await engine.close()
    assert engine.health() == STOPPING
    await starting
    assert made == [], "no model is loaded for a gateway that is going away"
    assert path.exists(), "the finished build is still cached for the next start"


def test_cli_build_chooses_layers_like_auto(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prismgate.instruments.packs.cli import main

    out = tmp_path / "pack.safetensors"
    assert main(["build", "--model", str(tiny_model_dir), "--layers", "auto", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().err
    pack = ConceptPack.load(out)
    assert pack.layers and set(pack.layers) <= {0, 1}, "the last of the 3 layers is left out when there is a choice"
    assert "chosen by the held-out separation report" in pack.method
    assert pack.directions.shape[0] == len(pack.layers) and pack.scales is not None
    assert pack.scales.shape[0] == len(pack.layers)
