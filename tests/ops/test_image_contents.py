"""What ``pip install .`` puts in the images, built from exactly the files the Dockerfiles COPY.

Without Docker we can still build the wheel the image would install, from a copy of
the build context that holds only what the Dockerfile copies, and check that the
things the container needs at run time are inside it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.ops import dockerfile_rules

ROOT = Path(__file__).resolve().parents[2]


def copied_paths(dockerfile: str) -> list[str]:
    """Sources of the COPY instructions that read from the build context (not --from=stage)."""
    paths: list[str] = []
    for ins in dockerfile_rules.parse((ROOT / dockerfile).read_text()):
        if ins.keyword == "COPY" and "--from=" not in ins.args:
            *sources, _dest = ins.args.split()
            paths += sources
    return paths


def test_both_images_copy_the_same_sources() -> None:
    assert copied_paths("Dockerfile") == copied_paths("Dockerfile.gpu")


def test_the_wheel_holds_what_the_container_needs(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for source in copied_paths("Dockerfile"):
        src = ROOT / source
        if src.is_dir():
            shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, context / source)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", str(tmp_path)],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("prismgate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = [
        "prismgate/server.py",
        "prismgate/observer.py",
        "prismgate/codecs/openai/__init__.py",
        "prismgate/schemas/salience.proto",
        # the default model's concept pack: without it the image serves no readouts
        "prismgate/engines/readouts/packs/smollm2-135m-instruct.safetensors",
        # --concept-pack auto (the GPU profile's default) builds with the instruments and their prompt sets
        "prismgate/instruments/packs/auto.py",
        "prismgate/instruments/packs/prompt_sets/sentiment.json",
    ]
    missing = [n for n in needed if n not in names]
    assert not missing, f"pip install . would leave out {missing} (see [tool.setuptools.package-data])"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "prismgate = prismgate.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
