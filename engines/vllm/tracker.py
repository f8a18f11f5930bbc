"""Gateway side of the side channel: per-request trackers fed once per engine step.

The worker's step packets and vLLM's own outputs travel on different sockets, so either
may arrive first. A request's stream therefore waits on its :class:`Tracker` for the
positions it needs ("the readout of position 17 has arrived") instead of assuming an
order. Rows are keyed by absolute position, so a position computed twice (chunked
prefill, preemption) simply overwrites itself. With pipeline parallelism each stage sends
the readouts of its own layers: a position's readout counts as arrived once every layer has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

import numpy as np
import numpy.typing as npt

from prismgate.core.errors import Code, GatewayError
from prismgate.engines.vllm.channel import LogprobRow, decode_step

log = logging.getLogger(__name__)

SIDE_CHANNEL_TIMEOUT_S = 60.0  # a step's packet arrives within milliseconds; this only catches a broken worker


class Tracker:
    """Everything the workers computed for one vLLM request, by absolute position."""

    def __init__(self, key: str, n_layers: int = 0) -> None:
        self.key = key
        self.n_layers = n_layers  # the pack's layers: what a complete readout holds
        self.readouts: dict[int, npt.NDArray[np.float32]] = {}
        self._partial: dict[int, tuple[npt.NDArray[np.float32], set[int]]] = {}  # pipeline stages still to come
        self.logprobs: dict[int, LogprobRow] = {}  # by target position
        self.computed: set[int] = set()
        self._changed = asyncio.Event()

    def feed(
        self,
        positions: npt.NDArray[np.int64],
        readouts: npt.NDArray[np.float32] | None,
        rows: list[LogprobRow],
        layers: list[int] | None = None,
    ) -> None:
        """One step's rows; ``layers`` are the pack's layers ``readouts`` holds (None: all of them)."""
        pos = positions.tolist()
        self.computed.update(pos)
        if readouts is not None:
            if layers is None or len(layers) == self.n_layers:
                for i, p in enumerate(pos):
                    self.readouts[p] = readouts[i]
            else:
                self._merge(pos, readouts, layers)
        for row in rows:
            self.logprobs[row[0]] = row
        self._changed.set()

    def _merge(self, positions: list[int], readouts: npt.NDArray[np.float32], layers: list[int]) -> None:
        for i, p in enumerate(positions):
            full, have = self._partial.get(p) or (np.zeros((self.n_layers, readouts.shape[2]), np.float32), set())
            full[layers] = readouts[i]
            have.update(layers)
            if len(have) == self.n_layers:
                self._partial.pop(p, None)
                self.readouts[p] = full
            else:
                self._partial[p] = (full, have)

    async def wait(self, ready: Callable[[], bool], limit_s: float) -> bool:
        """Wait until ``ready()`` holds; False when ``limit_s`` seconds pass first."""
        deadline = time.monotonic() + limit_s
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            if ready():
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def require(
        self, readouts: Collection[int], logprobs: Collection[int], what: str, limit_s: float = SIDE_CHANNEL_TIMEOUT_S
    ) -> None:
        """Wait for these positions' readouts and logprobs; if they never come, an INTERNAL error names ``what``."""
        ok = await self.wait(
            lambda: all(p in self.readouts for p in readouts) and all(p in self.logprobs for p in logprobs), limit_s
        )
        if not ok:
            raise GatewayError(Code.INTERNAL, f"the vLLM worker did not deliver {what}")


class Receiver:
    """Binds the PULL socket and routes each step's rows to the trackers that asked."""

    def __init__(self, n_layers: int = 0) -> None:
        import zmq
        import zmq.asyncio

        self._dir = tempfile.mkdtemp(prefix="prismgate-vllm-")
        os.chmod(self._dir, 0o700)
        self.address = f"ipc://{self._dir}/readouts.sock"
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self.n_layers = n_layers  # the concept pack's layers (0: no pack)
        self._trackers: dict[str, Tracker] = {}
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.rows_seen: OrderedDict[str, int] = OrderedDict()  # key -> rows received (bounded; for tests and metrics)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="prismgate-vllm-readouts")

    def open(self, key: str) -> Tracker:
        tracker = Tracker(key, self.n_layers)
        self._trackers[key] = tracker
        return tracker

    def drop(self, key: str) -> None:
        self._trackers.pop(key, None)

    async def _run(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                packet = decode_step(frames)
            except Exception:
                log.exception("prismgate: dropped a malformed readout packet")
                continue
            self.steps += 1
            for req in packet.requests:
                self.rows_seen[req.key] = self.rows_seen.get(req.key, 0) + int(req.positions.shape[0])
                self.rows_seen.move_to_end(req.key)
                while len(self.rows_seen) > 4096:
                    self.rows_seen.popitem(last=False)
                tracker = self._trackers.get(req.key)
                if tracker is not None:
                    tracker.feed(req.positions, req.readouts, req.logprobs, packet.layers)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        self._sock.close()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
