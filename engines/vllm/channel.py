"""The side channel that carries readouts, SAE features and prompt logprobs from vLLM's worker to the gateway.

One ZMQ PUSH socket in each worker that sends (see :mod:`.worker`), one PULL socket bound by the
gateway on an ``ipc://`` path inside a private temporary folder, one multipart message per
engine step: a JSON header, then nine frames per request of raw little-endian arrays
(docs/vllm.md, "The side channel's frames"). No pickle: the receiving end trusts nothing but
the shape it was told.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

LogprobRow = tuple[int, float, list[int], list[float]]  # target position, logprob, top ids, top logprobs


@dataclass
class FeatureRows:
    """One step's SAE features for one request: every SAE layer, largest first (see :mod:`.sae_op`)."""

    ids: npt.NDArray[np.int32]  # [n, sae layers, k]
    values: npt.NDArray[np.float32]  # [n, sae layers, k]
    watched: npt.NDArray[np.float32] | None = None  # [n, sae layers, the request's watched ids]


@dataclass
class LogprobRows:
    """One step's prompt logprobs for one request: per scored position, as arrays (no per-row Python)."""

    targets: npt.NDArray[np.int64]  # [m] the prompt positions scored
    values: npt.NDArray[np.float32]  # [m] each one's own token's logprob
    top_ids: npt.NDArray[np.int32]  # [m, k] the most likely tokens there, as topk orders them
    top_values: npt.NDArray[np.float32]  # [m, k] their logprobs

    @classmethod
    def of(cls, rows: Sequence[LogprobRow], k: int = 0) -> LogprobRows:
        """From (target, logprob, top ids, top logprobs) rows, each with ``k`` alternatives."""
        return cls(
            np.array([r[0] for r in rows], dtype=np.int64),
            np.array([r[1] for r in rows], dtype=np.float32),
            np.array([list(r[2]) for r in rows], dtype=np.int32).reshape(len(rows), k),
            np.array([list(r[3]) for r in rows], dtype=np.float32).reshape(len(rows), k),
        )

    def rows(self) -> list[LogprobRow]:
        """As (target, logprob, top ids, top logprobs) rows: what a tracker keeps by position."""
        columns = (self.targets.tolist(), self.values.tolist(), self.top_ids.tolist(), self.top_values.tolist())
        return list(zip(*columns, strict=True))


@dataclass
class RequestRows:
    """What one step computed for one request."""

    key: str
    positions: npt.NDArray[np.int64]
    readouts: npt.NDArray[np.float32] | None
    logprobs: LogprobRows | None = None
    features: FeatureRows | None = None


@dataclass
class StepPacket:
    step: int
    requests: list[RequestRows] = field(default_factory=list)
    layers: list[int] | None = None  # the pack's layers (indices) the readouts hold; None: all

    def add(
        self,
        key: str,
        positions: npt.NDArray[Any],
        readouts: npt.NDArray[Any] | None,
        logprobs: LogprobRows | None = None,
        features: FeatureRows | None = None,
    ) -> None:
        self.requests.append(
            RequestRows(
                key,
                np.ascontiguousarray(positions, dtype=np.int64),
                None if readouts is None else np.ascontiguousarray(readouts, dtype=np.float32),
                logprobs,
                features,
            )
        )


# positions, readouts, feature ids, feature values, watched features, then the prompt logprobs:
# targets, values, top ids, top values
FRAMES_PER_REQUEST = 9


def _shape(array: npt.NDArray[Any] | None) -> list[int] | None:
    return None if array is None else list(array.shape)


def _bytes(array: npt.NDArray[Any] | None, dtype: str) -> bytes:
    return b"" if array is None else np.ascontiguousarray(array).astype(dtype).tobytes()


def _array(frame: bytes, dtype: str, shape: list[int] | None, n: int, what: str) -> npt.NDArray[Any] | None:
    """A frame as an array of ``shape`` (None: the part is absent), whose first dimension must be ``n``;
    refused when it holds another size."""
    if shape is None:
        return None
    dims = tuple(int(x) for x in shape)
    if not dims or dims[0] != n or any(d < 0 for d in dims):
        raise ValueError(f"{what} of shape {dims} for {n} rows")
    flat = np.frombuffer(frame, dtype=dtype)
    if flat.size != int(np.prod(dims)):
        raise ValueError(f"{what}: {flat.size} values for shape {dims}")
    return flat.astype(dtype[1:] if dtype.startswith("<") else dtype).reshape(dims)


def encode_step(packet: StepPacket) -> list[bytes]:
    header: dict[str, Any] = {"step": packet.step, "layers": packet.layers, "reqs": []}
    frames: list[bytes] = [b""]
    for req in packet.requests:
        fe, lp = req.features, req.logprobs
        header["reqs"].append(
            {
                "key": req.key,
                "n": int(req.positions.shape[0]),
                "ro": None if req.readouts is None else list(req.readouts.shape),
                "lp": None if lp is None else list(lp.top_ids.shape),
                "fe": None if fe is None else list(fe.ids.shape),
                "fw": None if fe is None else _shape(fe.watched),
            }
        )
        frames.append(req.positions.astype("<i8").tobytes())
        frames.append(_bytes(req.readouts, "<f4"))
        frames.append(b"" if fe is None else _bytes(fe.ids, "<i4"))
        frames.append(b"" if fe is None else _bytes(fe.values, "<f4"))
        frames.append(b"" if fe is None else _bytes(fe.watched, "<f4"))
        frames.append(b"" if lp is None else _bytes(lp.targets, "<i8"))
        frames.append(b"" if lp is None else _bytes(lp.values, "<f4"))
        frames.append(b"" if lp is None else _bytes(lp.top_ids, "<i4"))
        frames.append(b"" if lp is None else _bytes(lp.top_values, "<f4"))
    frames[0] = json.dumps(header, separators=(",", ":")).encode()
    return frames


def decode_step(frames: Sequence[bytes]) -> StepPacket:
    header = json.loads(frames[0])
    layers = header.get("layers")
    packet = StepPacket(step=int(header["step"]), layers=None if layers is None else [int(i) for i in layers])
    if len(frames) != 1 + FRAMES_PER_REQUEST * len(header["reqs"]):
        raise ValueError(f"step packet has {len(frames)} frames for {len(header['reqs'])} requests")
    for i, req in enumerate(header["reqs"]):
        n = int(req["n"])
        own = frames[1 + FRAMES_PER_REQUEST * i : 1 + FRAMES_PER_REQUEST * (i + 1)]
        positions = np.frombuffer(own[0], dtype="<i8").astype(np.int64)
        if positions.shape[0] != n:
            raise ValueError(f"request {req['key']}: {positions.shape[0]} positions, header says {n}")
        what = f"request {req['key']}:"
        readouts = _array(own[1], "<f4", req["ro"], n, f"{what} readouts")
        if readouts is not None and packet.layers is not None and readouts.shape[1:2] != (len(packet.layers),):
            raise ValueError(f"{what} readouts of shape {readouts.shape} for layers {packet.layers}")
        features = None
        top_ids = _array(own[2], "<i4", req.get("fe"), n, f"{what} feature ids")
        if top_ids is not None:
            values = _array(own[3], "<f4", req["fe"], n, f"{what} feature values")
            watched = _array(own[4], "<f4", req.get("fw"), n, f"{what} watched features")
            assert values is not None
            features = FeatureRows(top_ids, values, watched)
        logprobs = None
        if req.get("lp") is not None:
            lp = req["lp"]
            m = int(lp[0]) if isinstance(lp, list) and len(lp) == 2 else -1
            targets = _array(own[5], "<i8", [m], m, f"{what} logprob targets")
            values = _array(own[6], "<f4", [m], m, f"{what} logprobs")
            top_ids = _array(own[7], "<i4", lp, m, f"{what} top logprob ids")
            top_values = _array(own[8], "<f4", lp, m, f"{what} top logprobs")
            assert targets is not None and values is not None and top_ids is not None and top_values is not None
            logprobs = LogprobRows(targets, values, top_ids, top_values)
        packet.requests.append(RequestRows(str(req["key"]), positions, readouts, logprobs, features))
    return packet


class Sender:
    """Worker side: a PUSH socket that never blocks the engine step.

    Its context is its own, and that context's I/O thread runs under ``SCHED_BATCH``: a send
    only queues the frames and wakes that thread, and a woken thread of the normal class
    preempts the one that woke it when every core is busy (on a small CPU the engine core's
    spin and the front-end hold the others), stalling the step for a scheduler slice. A batch
    thread runs when a core is free, which is as soon as the step ends (figures in
    docs/benchmarks.md, "Where a vLLM decode step's time goes").
    """

    def __init__(self, address: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        if hasattr(os, "SCHED_BATCH"):  # Linux; set before the first socket starts the I/O thread
            self._ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
            self._ctx.set(zmq.THREAD_PRIORITY, 0)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # unbounded: dropping a step would lose readouts
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def send(self, frames: list[bytes]) -> None:
        self._sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
