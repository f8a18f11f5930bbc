"""The model cache is shared: a folder converted by one user loads as another.

An image converts the default model at build time as root and serves it as an unprivileged
user; a host may share one cache between users. The conversion's staging folder must not
keep a private mode once it is renamed into place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from prismgate.engines import models
from tests.tiny_model import build_tiny_llama

OTHER_USER = 65534  # nobody

# Runs as root until it has imported and used everything it needs (the interpreter itself may
# live in a folder only root can enter), then becomes the other user and loads from the cache.
LOAD_AS_OTHER_USER = """
import os, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from prismgate.engines import models
warm = sys.argv[1]
AutoTokenizer.from_pretrained(warm)
AutoModelForCausalLM.from_pretrained(warm)
os.setgid({uid})
os.setuid({uid})
assert models.default_model_converted(), "the converted model is not visible to this user"
folder = models.default_model_path()
AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
print("loaded", model.config.model_type, "as uid", os.getuid())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_a_cache_converted_by_one_user_loads_as_another(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build_tiny_llama(tmp_path / "tiny")
    # A shared place every user can enter (pytest's own tmp_path is private to root).
    with tempfile.TemporaryDirectory(prefix="prismgate-shared-cache-") as shared:
        os.chmod(shared, 0o755)
        os.environ["PRISMGATE_CACHE_DIR"] = shared
        try:
            target = models.default_model_target()  # under the shared cache, while the variable names it
            models._save_atomically(
                target,
                AutoModelForCausalLM.from_pretrained(source),
                AutoTokenizer.from_pretrained(source),
            )
        finally:
            del os.environ["PRISMGATE_CACHE_DIR"]
        result = subprocess.run(
            [sys.executable, "-c", LOAD_AS_OTHER_USER.format(uid=OTHER_USER), str(source)],
            env={**os.environ, "PRISMGATE_CACHE_DIR": shared, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"loaded llama as uid {OTHER_USER}" in result.stdout
        leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(".convert-")]
        assert leftovers == [], "the staging folder was left behind"


def test_a_conversion_that_finishes_second_keeps_the_first_ones_folder(tmp_path: Path) -> None:
    """Two processes converting at once (replicas, test tiers side by side): the one that finishes
    second leaves the folder the first put in place, which others may already be reading."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build_tiny_llama(tmp_path / "tiny")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    target = tmp_path / "cache" / "models" / "converted"
    models._save_atomically(target, model, tokenizer)
    first = (target / "model.safetensors").stat().st_ino
    models._save_atomically(target, model, tokenizer)
    assert (target / "model.safetensors").stat().st_ino == first, "the first conversion's folder was replaced"
    assert [p.name for p in target.parent.iterdir()] == ["converted"], "a staging folder was left behind"
