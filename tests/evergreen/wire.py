"""Test helpers: build Evergreen messages as a real JSON client would, and read replies."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from prismgate.schemas import evergreen_pb2 as pb

EOT = "application/x-protobuf; type=EndOfTurn"
STRUCT = "type.googleapis.com/google.protobuf.Struct"
CONFIG = "type.googleapis.com/prismgate.evergreen.v1.GenerateConfig"


def uid() -> str:
    return str(uuid.uuid4())


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def text_leaf(node_id: str, text: str, *, role: str | None = None, seq: int = 0, continued: bool = False) -> dict:
    metadata: dict[str, Any] = {"mimetype": "text/plain"}
    if role:
        metadata["role"] = role
    out: dict[str, Any] = {"id": node_id, "chunkFragment": {"metadata": metadata, "data": b64(text)}}
    if seq:
        out["seq"] = seq
    if continued:
        out["continued"] = True
    return out


def eot_leaf(node_id: str) -> dict:
    return {"id": node_id, "chunkFragment": {"metadata": {"mimetype": EOT}}}


def parent(node_id: str, *children: str, seq: int = 0, continued: bool = False) -> dict:
    out: dict[str, Any] = {"id": node_id, "childIds": list(children)}
    if seq:
        out["seq"] = seq
    if continued:
        out["continued"] = True
    return out


def generate(
    prompt: str,
    response: str,
    *,
    input_name: str = "prompt",
    output_name: str = "response",
    config: dict | None = None,
    extra_outputs: dict[str, str] | None = None,
) -> dict:
    action: dict[str, Any] = {
        "name": "GENERATE",
        "inputs": [{"name": input_name, "id": prompt}],
        "outputs": [{"name": output_name, "id": response}]
        + [{"name": k, "id": v} for k, v in (extra_outputs or {}).items()],
    }
    if config is not None:
        action["configs"] = [{"@type": STRUCT, "value": config}]
    return action


def msg(*, actions: list[dict] | None = None, fragments: list[dict] | None = None) -> str:
    out: dict[str, Any] = {}
    if actions:
        out["actions"] = actions
    if fragments:
        out["nodeFragments"] = fragments
    return json.dumps(out)


@dataclass
class Output:
    """One output node as received: fragments by seq, and whether its final one came."""

    fragments: dict[int, dict] = field(default_factory=dict)
    final_seq: int | None = None
    arrival: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.final_seq is not None and len(self.fragments) == self.final_seq + 1

    @property
    def data(self) -> bytes:
        return b"".join(
            base64.b64decode(f.get("chunkFragment", {}).get("data", "")) for _, f in sorted(self.fragments.items())
        )

    @property
    def text(self) -> str:
        return self.data.decode()

    @property
    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.data.decode().splitlines() if line.strip()]

    @property
    def metadata(self) -> dict:
        return self.fragments[0].get("chunkFragment", {}).get("metadata", {})


class Collector:
    """Reads frames from a websockets client connection into outputs by node id."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.outputs: dict[str, Output] = {}
        self.frames: list[Any] = []

    def add(self, message: dict) -> None:
        for f in message.get("nodeFragments", []):
            out = self.outputs.setdefault(f["id"], Output())
            seq = int(f.get("seq", 0))
            assert seq not in out.fragments, f"server sent seq {seq} of {f['id']} twice"
            out.fragments[seq] = f
            out.arrival.append(seq)
            if not f.get("continued", False):
                out.final_seq = seq

    async def until_complete(self, *ids: str, within: float = 120.0) -> dict[str, Output]:
        async with asyncio.timeout(within):
            while not all(i in self.outputs and self.outputs[i].complete for i in ids):
                frame = await self.ws.recv()
                self.frames.append(frame)
                if isinstance(frame, bytes):
                    parsed = pb.SessionMessage()
                    parsed.ParseFromString(frame)
                    self.add(json_format.MessageToDict(parsed))
                else:
                    self.add(json.loads(frame))
        return {i: self.outputs[i] for i in ids}


async def closed_with(ws: Any, within: float = 60.0) -> tuple[int, str]:
    """Read until the server closes; return (code, reason)."""
    import websockets

    async with asyncio.timeout(within):
        try:
            while True:
                await ws.recv()
        except websockets.ConnectionClosed as exc:
            assert exc.rcvd is not None, "the connection closed without a close frame"
            return exc.rcvd.code, exc.rcvd.reason
