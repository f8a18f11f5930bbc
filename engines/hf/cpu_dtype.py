"""The dtype ``--dtype auto`` serves in, and why.

On a GPU, and on a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX), ``auto`` keeps
the dtype the weights were saved in. On any other CPU, bfloat16 weights are served in float32:
without those instructions every bf16 product converts its operands to float32 and back, so
float32 is the faster of the two (docs/benchmarks.md, "The dtype auto picks"). The rule reads
only the CPU's flags, so a machine picks the same dtype on every start and its results stay
reproducible. An explicit dtype always wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prismgate.core.errors import invalid

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # as /proc/cpuinfo names them


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype a model is served in, and the reason, as /readyz, /v1/models and the log say it."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU's feature flags, or None where the system does not list them (not Linux: ``auto``
    then keeps the weights' dtype)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


def choose_dtype(name: str, saved: str | None, device: str, flags: frozenset[str] | None) -> DtypeChoice:
    """The dtype ``name`` (a setting's value) resolves to for weights saved in ``saved``; without
    the CPU's ``flags``, ``auto`` is the weights' dtype."""
    if name != "auto":
        if name not in DTYPES:
            raise invalid(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
        return DtypeChoice(DTYPES[name], "set by the dtype setting")
    weights = DTYPES.get(saved or "", torch.bfloat16)
    kept = DtypeChoice(weights, f"auto: the weights' dtype ({saved or 'not recorded: bfloat16'})")
    if device != "cpu" or weights is not torch.bfloat16 or flags is None:
        return kept
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if native:
        return DtypeChoice(weights, f"auto: the weights' dtype; this CPU has {native[0]}")
    return DtypeChoice(torch.float32, "auto: float32, faster here: this CPU has neither amx_bf16 nor avx512_bf16")
