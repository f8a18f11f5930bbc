"""The switch for batch-invariant forward passes, and matrix products whose rows never mix.

CPU GEMM kernels pick their blocking by the number of rows ``M``: measured with torch 2.13's
MKL and oneDNN, float32 products of one row and of two or three rows each take a kernel of their
own, while every ``M >= 8`` gives each row the same bits in any slot. bf16 products look invariant
on random data, but only because rounding to bf16 hides a different order of additions most of the
time: on real activations a one-row product differs (seen in SmolLM2's ``down_proj``), while
products of two rows and more agree with each other, so bf16 products are padded to two rows and
the others to eight. The engine's start-up check and tests/engines/test_determinism.py hold these
measurements to account on real activations. While the switch is on, a shorter product is padded
with zero rows, so a row meets one kernel whatever runs beside it. The transformers
engine's kernels (:mod:`prismgate.engines.hf.invariant`) and the readout probe read the switch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

MIN_ROWS = 8  # matrix products run on at least this many rows while the switch is on...
MIN_ROWS_BY_DTYPE = {torch.bfloat16: 2}  # ...or this many, where one-row products alone take a kernel of their own


def min_rows(dtype: torch.dtype) -> int:
    """The fewest rows a product of ``dtype`` inputs runs on while the switch is on."""
    return MIN_ROWS_BY_DTYPE.get(dtype, MIN_ROWS)


class InvariantSwitch(threading.local):
    """Whether this thread's next forward passes run batch-invariant.

    Per thread: replicas of a model in one process each run their passes on a thread of their
    own, and one replica's deterministic pass must not turn another's kernels on or off.
    """

    active = False

    @contextlib.contextmanager
    def on(self, active: bool = True) -> Iterator[None]:
        before, self.active = self.active, active
        try:
            yield
        finally:
            self.active = before


SWITCH = InvariantSwitch()  # every model thread of the process reads its own value


def padded_rows(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, int]:
    """``x`` as a 2-D ``[max(n, rows), features]`` matrix (zero rows added) and its own row count ``n``;
    ``rows`` defaults to what ``x``'s dtype needs (:func:`min_rows`)."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    rows = min_rows(x.dtype) if rows is None else rows
    if n >= rows:
        return flat, n
    return F.pad(flat, (0, 0, 0, rows - n)), n


def on_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` for a row-by-row product over the last dimension, run on a padded matrix
    when ``x`` has fewer rows than its dtype needs (:func:`padded_rows`)."""
    flat, n = padded_rows(x)
    if flat.shape[0] == n:
        return product(x)
    out = product(flat)
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


def matmul_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` over the last dimension, each row with the kernel it gets in any batch."""
    return on_rows(x, lambda rows: rows @ weight) if SWITCH.active else x @ weight
