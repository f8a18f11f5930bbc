"""The side channel that carries readouts and prompt logprobs from vLLM's worker to the gateway.

One ZMQ PUSH socket in each worker that sends (see :mod:`.worker`), one PULL socket bound by the gateway on an
``ipc://`` path inside a private temporary folder. One multipart message per engine step:

* frame 0: JSON header ``{"step": n, "layers": [pack indices] | null, "reqs": [{"key", "n",
  "ro": [n, layers, concepts] | null, "lp": [[target_position, logprob, [top ids], [top logprobs]],
  ...]}, ...]}``; ``layers`` names the pack's layers the readouts hold when the sender computes
  only some of them (a pipeline stage), null when it computes all;
* then, per request in header order, its absolute positions (``int64[n]``) and, when
  ``ro`` is set, its readouts (``float32[n, layers, concepts]``).

Plain JSON and raw little-endian arrays, no pickle: the receiving end trusts nothing but
the shape it was told.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

LogprobRow = tuple[int, float, list[int], list[float]]  # target position, logprob, top ids, top logprobs


@dataclass
class RequestRows:
    """What one step computed for one request."""

    key: str
    positions: npt.NDArray[np.int64]
    readouts: npt.NDArray[np.float32] | None
    logprobs: list[LogprobRow] = field(default_factory=list)


@dataclass
class StepPacket:
    step: int
    requests: list[RequestRows] = field(default_factory=list)
    layers: list[int] | None = None  # the pack's layers (indices) the readouts hold; None: all

    def add(
        self, key: str, positions: npt.NDArray[Any], readouts: npt.NDArray[Any] | None, logprobs: Sequence[LogprobRow]
    ) -> None:
        self.requests.append(
            RequestRows(
                key,
                np.ascontiguousarray(positions, dtype=np.int64),
                None if readouts is None else np.ascontiguousarray(readouts, dtype=np.float32),
                list(logprobs),
            )
        )


def encode_step(packet: StepPacket) -> list[bytes]:
    header: dict[str, Any] = {"step": packet.step, "layers": packet.layers, "reqs": []}
    frames: list[bytes] = [b""]
    for req in packet.requests:
        header["reqs"].append(
            {
                "key": req.key,
                "n": int(req.positions.shape[0]),
                "ro": None if req.readouts is None else list(req.readouts.shape),
                "lp": [
                    [int(t), float(v), [int(i) for i in ids], [float(x) for x in vals]]
                    for t, v, ids, vals in req.logprobs
                ],
            }
        )
        frames.append(req.positions.astype("<i8").tobytes())
        frames.append(b"" if req.readouts is None else req.readouts.astype("<f4").tobytes())
    frames[0] = json.dumps(header, separators=(",", ":")).encode()
    return frames


def decode_step(frames: Sequence[bytes]) -> StepPacket:
    header = json.loads(frames[0])
    layers = header.get("layers")
    packet = StepPacket(step=int(header["step"]), layers=None if layers is None else [int(i) for i in layers])
    if len(frames) != 1 + 2 * len(header["reqs"]):
        raise ValueError(f"step packet has {len(frames)} frames for {len(header['reqs'])} requests")
    for i, req in enumerate(header["reqs"]):
        n = int(req["n"])
        positions = np.frombuffer(frames[1 + 2 * i], dtype="<i8").astype(np.int64)
        if positions.shape[0] != n:
            raise ValueError(f"request {req['key']}: {positions.shape[0]} positions, header says {n}")
        readouts = None
        if req["ro"] is not None:
            shape = tuple(int(x) for x in req["ro"])
            readouts = np.frombuffer(frames[2 + 2 * i], dtype="<f4").astype(np.float32).reshape(shape)
            if shape[0] != n:
                raise ValueError(f"request {req['key']}: {shape[0]} readout rows for {n} positions")
            if packet.layers is not None and shape[1:2] != (len(packet.layers),):
                raise ValueError(f"request {req['key']}: readouts of shape {shape} for layers {packet.layers}")
        rows = [(int(t), float(v), [int(x) for x in ids], [float(x) for x in vals]) for t, v, ids, vals in req["lp"]]
        packet.requests.append(RequestRows(str(req["key"]), positions, readouts, rows))
    return packet


class Sender:
    """Worker side: a PUSH socket that never blocks the engine step."""

    def __init__(self, address: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # unbounded: dropping a step would lose readouts
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    def send(self, frames: list[bytes]) -> None:
        self._sock.send_multipart(frames, copy=False)

    def close(self) -> None:
        self._sock.close()
