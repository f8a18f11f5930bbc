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
from collections import OrderedDict
from collections.abc import Callable, Collection

import numpy as np
import numpy.typing as npt

from prismgate.core.errors import Code, GatewayError
from prismgate.engines.vllm.channel import FeatureRows, LogprobRow, LogprobRows, StepPacket, decode_step
from prismgate.engines.vllm.features import FeatureRow

log = logging.getLogger(__name__)

SIDE_CHANNEL_TIMEOUT_S = 60.0  # a step's packet arrives within milliseconds; this only catches a broken worker


class Tracker:
    """Everything the workers computed for one vLLM request, by absolute position."""

    def __init__(self, key: str, n_layers: int = 0, watch: tuple[int, ...] = ()) -> None:
        self.key = key
        self.n_layers = n_layers  # the pack's layers: what a complete readout holds
        self.watch = watch  # the feature ids this request watches: the columns of its rows' ``watched``
        self.features: dict[int, FeatureRow] = {}
        self.readouts: dict[int, npt.NDArray[np.float32]] = {}
        self._partial: dict[int, tuple[npt.NDArray[np.float32], set[int]]] = {}  # pipeline stages still to come
        self.logprobs: dict[int, LogprobRow] = {}  # by target position
        self.computed: set[int] = set()
        self._changed = asyncio.Event()

    def feed(
        self,
        positions: npt.NDArray[np.int64],
        readouts: npt.NDArray[np.float32] | None,
        logprobs: LogprobRows | None = None,
        layers: list[int] | None = None,
        features: FeatureRows | None = None,
    ) -> None:
        """One step's rows; ``layers`` are the pack's layers ``readouts`` holds (None: all of them)."""
        pos = positions.tolist()
        self.computed.update(pos)
        if features is not None:
            watched = features.watched
            for i, p in enumerate(pos):
                self.features[p] = FeatureRow(
                    features.ids[i], features.values[i], self.watch, None if watched is None else watched[i]
                )
        if readouts is not None:
            if layers is None or len(layers) == self.n_layers:
                for i, p in enumerate(pos):
                    self.readouts[p] = readouts[i]
            else:
                self._merge(pos, readouts, layers)
        if logprobs is not None:
            for row in logprobs.rows():
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
        """Wait until ``ready()`` holds; False when ``limit_s`` seconds pass first.

        A stream with readouts waits here for nearly every token (the step's packet and
        vLLM's output race), so the wait is one timeout scope, not a task per wake-up.
        """
        if ready():
            return True
        try:
            async with asyncio.timeout(limit_s):
                while not ready():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            return ready()
        return True

    async def require(
        self,
        readouts: Collection[int],
        logprobs: Collection[int],
        what: str,
        limit_s: float = SIDE_CHANNEL_TIMEOUT_S,
        features: Collection[int] = (),
    ) -> None:
        """Wait for these positions' readouts, logprobs and features; if they never come, an INTERNAL error
        names ``what``."""
        ok = await self.wait(
            lambda: (
                all(p in self.readouts for p in readouts)
                and all(p in self.logprobs for p in logprobs)
                and all(p in self.features for p in features)
            ),
            limit_s,
        )
        if not ok:
            raise GatewayError(Code.INTERNAL, f"the vLLM worker did not deliver {what}")


class Receiver:
    """Binds the PULL socket and routes each step's rows to the trackers that asked."""

    def __init__(self, n_layers: int = 0, address: str | None = None) -> None:
        """Bind ``address`` (``tcp://HOST:PORT``, for workers on other nodes), or a private ``ipc://`` socket."""
        import zmq

        self._zmq = zmq
        self._dir: str | None = None
        if address is None:
            self._dir = tempfile.mkdtemp(prefix="prismgate-vllm-")
            os.chmod(self._dir, 0o700)
            address = f"ipc://{self._dir}/readouts.sock"
        self.address = address
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self.n_layers = n_layers  # the concept pack's layers (0: no pack)
        self._trackers: dict[str, Tracker] = {}
        self._fd: int | None = None
        self.steps = 0
        self.rows_seen: OrderedDict[str, int] = OrderedDict()  # key -> rows received (bounded; for tests and metrics)

    def start(self) -> None:
        """Read the socket from the event loop's own poller: a packet arrives every engine step.

        Not through ``zmq.asyncio``, which makes a future (and re-registers the socket) per
        message: here one readiness callback takes every packet that is waiting.
        """
        self._fd = int(self._sock.getsockopt(self._zmq.FD))
        asyncio.get_running_loop().add_reader(self._fd, self._drain)
        self._drain()  # the descriptor only signals changes: take what came before we listened

    def open(self, key: str, watch: tuple[int, ...] = ()) -> Tracker:
        tracker = Tracker(key, self.n_layers, watch)
        self._trackers[key] = tracker
        return tracker

    def drop(self, key: str) -> None:
        self._trackers.pop(key, None)

    def _drain(self) -> None:
        zmq = self._zmq
        # ZMQ's descriptor is edge-triggered: read until the socket says nothing is left
        while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                packet = decode_step(frames)
            except Exception:
                log.exception("prismgate: dropped a malformed readout packet")
                continue
            self._route(packet)

    def _route(self, packet: StepPacket) -> None:
        self.steps += 1
        for req in packet.requests:
            self.rows_seen[req.key] = self.rows_seen.get(req.key, 0) + int(req.positions.shape[0])
            self.rows_seen.move_to_end(req.key)
            while len(self.rows_seen) > 4096:
                self.rows_seen.popitem(last=False)
            tracker = self._trackers.get(req.key)
            if tracker is not None:
                tracker.feed(req.positions, req.readouts, req.logprobs, packet.layers, req.features)

    async def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = None
        self._sock.close()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
