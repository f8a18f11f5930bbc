"""The Evergreen JSON printer prints every message as protobuf's ``MessageToJson`` does, byte for byte."""

from __future__ import annotations

import random

from google.protobuf import json_format

from prismgate.codecs.evergreen.fragments import NodeWriter
from prismgate.codecs.evergreen.json_frames import to_json
from prismgate.schemas import evergreen_pb2 as pb

IDS = ["r", "ro", "", "a1", 'quo"te\\', "caf\u00e9", "\U0001f600", "tab\tnl\n", "\u2028"]


def fragment(rng: random.Random) -> pb.NodeFragment:
    f = pb.NodeFragment(id=rng.choice(IDS), seq=rng.choice([0, 1, 7, 2**31 - 1]), continued=rng.random() < 0.5)
    kind = rng.randrange(7)
    if kind == 0:
        return f  # no chunk: a closing terminator
    if kind == 1:
        f.child_ids.extend(["a", "b"])
    elif kind == 2:
        f.chunk_fragment.metadata.mimetype = "text/plain"
    elif kind == 3:
        f.chunk_fragment.ref = "data:,x"
    elif kind == 4:
        f.chunk_fragment.data = b""
    elif kind == 5:
        f.chunk_fragment.SetInParent()
    f.chunk_fragment.data = f.chunk_fragment.data or bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    return f


def test_every_message_prints_as_message_to_json() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        message = pb.SessionMessage(node_fragments=[fragment(rng) for _ in range(rng.randrange(0, 4))])
        if rng.random() < 0.05:
            message.actions.add(name="GENERATE")
        assert to_json(message) == json_format.MessageToJson(message, indent=None)


def test_a_generations_fragments_print_as_message_to_json() -> None:
    text, readouts = NodeWriter("r", "text/plain", "assistant"), NodeWriter("ro", "application/x-ndjson")
    sent = [[text.chunk(b"Hi"), readouts.chunk(b'{"values":"AAAA"}\n')] for _ in range(4)]
    sent.append([text.close(b" there"), readouts.close()])
    for fragments in sent:
        message = pb.SessionMessage(node_fragments=fragments)
        assert to_json(message) == json_format.MessageToJson(message, indent=None)
