"""The switch for batch-invariant forward passes, and matrix products whose rows never mix.

CPU GEMM kernels pick their blocking by the number of rows ``M``, and which ``M`` share a kernel
depends on the CPU and the shape: with torch 2.13, float32 products of one row, of 2-15 rows and
of 16 rows and more each add in an order of their own on a CPU with AMX, where a CPU with
AVX-512 alone gives every ``M >= 8`` the same bits; a bf16 LM head there splits its row counts
into classes that are not even intervals. No row count to pad to holds on every CPU, so while
the switch is on every product runs in blocks of exactly :data:`BLOCK_ROWS` rows (zero rows pad
the last): a row meets the same kernel, the same order of additions, whatever runs beside it
and on any CPU. The engine's start-up check and tests/engines/test_determinism.py hold this to
account on real activations. The transformers engine's kernels
(:mod:`prismgate.engines.hf.invariant`) and the readout probe read the switch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

BLOCK_ROWS = 8  # rows of every product while the switch is on: the fewest that one-row decodes pay for


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


def in_blocks(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)`` for a row-by-row product over the last dimension, run on blocks of exactly
    :data:`BLOCK_ROWS` rows of ``x`` (the last one padded with zero rows)."""
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    blocks = -(-n // BLOCK_ROWS)
    if blocks * BLOCK_ROWS != n:
        flat = F.pad(flat, (0, 0, 0, blocks * BLOCK_ROWS - n))
    if blocks <= 1:
        out = product(flat)
    else:
        out = torch.cat([product(flat[i * BLOCK_ROWS : (i + 1) * BLOCK_ROWS]) for i in range(blocks)])
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


def on_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``product(x)``, in blocks of :data:`BLOCK_ROWS` rows while this thread's switch is on."""
    return in_blocks(x, product) if SWITCH.active else product(x)


def matmul_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` over the last dimension, each row with the kernel it gets in any batch."""
    return on_rows(x, lambda rows: rows @ weight)
