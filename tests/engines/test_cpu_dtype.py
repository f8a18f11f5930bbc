"""``--dtype auto`` on a CPU: bf16 where the CPU has native bf16, float32 elsewhere; said where users look."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from prismgate.core.errors import GatewayError
from prismgate.engines.hf.cpu_dtype import NATIVE_BF16_FLAGS, choose_dtype, cpu_flags
from prismgate.engines.hf.loading import load

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl"}


@pytest.mark.parametrize("native", NATIVE_BF16_FLAGS)
def test_native_bf16_keeps_the_weights_dtype(native: str) -> None:
    choice = choose_dtype("auto", "bfloat16", "cpu", AVX512 | {native})
    assert choice.dtype is torch.bfloat16
    assert native in choice.reason


@pytest.mark.parametrize("flags", [AVX2, AVX512], ids=["avx2", "avx512-without-bf16"])
def test_emulated_bf16_is_served_in_float32(flags: frozenset[str]) -> None:
    for saved in ("bfloat16", None):  # weights that record no dtype are taken as bf16
        choice = choose_dtype("auto", saved, "cpu", flags)
        assert choice.dtype is torch.float32
        assert "neither amx_bf16 nor avx512_bf16" in choice.reason


def test_what_the_rule_leaves_alone() -> None:
    # an explicit dtype always wins, on any CPU
    assert choose_dtype("bfloat16", "bfloat16", "cpu", AVX2).dtype is torch.bfloat16
    assert choose_dtype("bfloat16", "float32", "cpu", AVX2).reason == "set by the dtype setting"
    # a GPU, float32 or float16 weights, and no flags (not Linux; the instruments) keep the weights' dtype
    assert choose_dtype("auto", "bfloat16", "cuda", AVX2).dtype is torch.bfloat16
    assert choose_dtype("auto", "float32", "cpu", AVX2).dtype is torch.float32
    assert choose_dtype("auto", "float16", "cpu", AVX2).dtype is torch.float16
    assert choose_dtype("auto", "bfloat16", "cpu", None).dtype is torch.bfloat16
    with pytest.raises(GatewayError, match="dtype must be one of auto, bfloat16, float16, float32; got 'int8'"):
        choose_dtype("int8", None, "cpu", AVX2)


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\nbugs\t\t: spectre\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") is None


def _expected_here() -> torch.dtype:
    flags = cpu_flags()
    native = flags is None or any(f in flags for f in NATIVE_BF16_FLAGS)
    return torch.bfloat16 if native else torch.float32


def test_the_engine_loads_and_reports_the_choice(tiny_model_dir: Path, tmp_path: Path) -> None:
    bf16_model = tmp_path / "bf16-model"
    shutil.copytree(tiny_model_dir, bf16_model)
    config = json.loads((bf16_model / "config.json").read_text())
    (bf16_model / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))

    auto = load(bf16_model, model_id="m", concept_pack=None, device="cpu", dtype="auto", max_model_len=None)
    assert auto.adapter.model.dtype is _expected_here()
    assert auto.info.dtype == str(_expected_here()).removeprefix("torch.")
    assert auto.info.dtype_reason.startswith("auto: ")

    pinned = load(bf16_model, model_id="m", concept_pack=None, device="cpu", dtype="float32", max_model_len=None)
    assert (pinned.adapter.model.dtype, pinned.info.dtype) == (torch.float32, "float32")
    assert pinned.info.dtype_reason == "set by the dtype setting"


def test_readyz_and_models_say_which_dtype_and_why(live_server) -> None:  # type: ignore[no-untyped-def]
    ready = httpx.get(f"{live_server.http_url}/readyz", timeout=30).json()
    listed = httpx.get(f"{live_server.http_url}/v1/models", timeout=30).json()["data"][0]
    # the tests' tiny model is saved in float32, which auto keeps on every CPU
    assert ready["dtype"] == {"name": "float32", "reason": "auto: the weights' dtype (float32)"}, ready
    assert listed["prismgate"]["dtype"] == ready["dtype"], listed
