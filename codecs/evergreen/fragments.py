"""Writing one output node as a stream of fragments.

An Evergreen node is sent in fragments numbered by ``seq``; the first carries the
chunk's metadata, the last has ``continued`` unset. A writer keeps that bookkeeping
for one output node, so the code that produces the content never counts fragments.
"""

from __future__ import annotations

from prismgate.schemas import evergreen_pb2 as pb


class NodeWriter:
    """The fragments of one output node, in order."""

    def __init__(self, node_id: str, mimetype: str, role: str = "") -> None:
        self.id = node_id
        self.metadata = pb.ChunkMetadata(mimetype=mimetype, role=role)
        self.seq = 0
        self.closed = False

    def chunk(self, data: bytes, *, final: bool = False) -> pb.NodeFragment:
        fragment = pb.NodeFragment(id=self.id, seq=self.seq, continued=not final)
        fragment.chunk_fragment.data = data
        if self.seq == 0:
            fragment.chunk_fragment.metadata.CopyFrom(self.metadata)
        self.seq += 1
        self.closed = final
        return fragment

    def close(self, data: bytes = b"") -> pb.NodeFragment:
        """The final fragment: with data (or, at seq 0, the metadata), else an empty terminator."""
        if data or self.seq == 0:
            return self.chunk(data, final=True)
        fragment = pb.NodeFragment(id=self.id, seq=self.seq, continued=False)
        self.seq += 1
        self.closed = True
        return fragment
