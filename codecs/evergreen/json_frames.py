"""A ``SessionMessage`` as proto3 JSON text, the same bytes ``json_format.MessageToJson`` prints.

Why a printer of its own: a JSON client gets one message per generated token (a text
fragment, and a readouts and a logprobs line when it asked), and protobuf's JSON printer
walks every message field by field in Python, as much time a fragment as the rest of the
token's path (figures in docs/benchmarks.md). The messages a generation sends per token are always the same shape
(node fragments with an id, a seq, ``continued`` and inline data), so those are printed
here from precomputed pieces; every other message (actions, metadata, refs, children)
goes to ``MessageToJson``. ``tests/evergreen/test_json_frames.py`` pins the bytes.
"""

from __future__ import annotations

import base64
import json

from google.protobuf import json_format

from prismgate.schemas import evergreen_pb2 as pb

_string = json.JSONEncoder().encode  # ensure_ascii, as MessageToJson prints strings


def to_json(message: pb.SessionMessage) -> str:
    """``json_format.MessageToJson(message, indent=None)``, fast for per-token messages."""
    if message.actions or not message.node_fragments:
        return json_format.MessageToJson(message, indent=None)
    parts = []
    for fragment in message.node_fragments:
        text = _fragment(fragment)
        if text is None:
            return json_format.MessageToJson(message, indent=None)
        parts.append(text)
    return '{"nodeFragments": [' + ", ".join(parts) + "]}"


def _fragment(fragment: pb.NodeFragment) -> str | None:
    """One fragment's JSON object (fields in number order, defaults left out), or None to print it the general way."""
    if fragment.child_ids:
        return None
    members = []
    if fragment.id:
        members.append('"id": ' + _string(fragment.id))
    if fragment.seq:
        members.append(f'"seq": {fragment.seq:d}')
    if fragment.continued:
        members.append('"continued": true')
    if fragment.HasField("chunk_fragment"):
        chunk = fragment.chunk_fragment
        if chunk.HasField("metadata") or chunk.WhichOneof("payload") != "data" or not chunk.data:
            return None
        members.append('"chunkFragment": {"data": "' + base64.b64encode(chunk.data).decode("ascii") + '"}')
    return "{" + ", ".join(members) + "}"
