"""ActionEngine messages <-> Evergreen ``SessionMessage``s, so both wires run one session code.

Inbound (:func:`inbound`, pure, run off the event loop with the decoding): an ActionEngine
node is a stream of chunks, each with its own mimetype and attributes, so a node becomes an
Evergreen non-leaf whose children are its chunks, one leaf ``<node id>[<seq>]`` each (a
conversation's turns in one ``prompt`` node keep their roles); the null chunk that ends a
node becomes the empty final fragment; a node ref becomes a child id (an earlier answer,
named instead of re-sent). An action's ``config`` input is taken out of the action: the
GENERATE is held until that node completes (:mod:`.link`).

Outbound (:class:`Writer`): each fragment of an output becomes a chunk carrying its mimetype
(ActionEngine readers expect one on every chunk), an output's empty final fragment the null
chunk, and once every output of an action has ended, the action's ``<id>#__status__`` node
gets the OK status, as the library's own server writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prismgate.codecs.actionengine import wire
from prismgate.core.errors import GatewayError, invalid
from prismgate.schemas import evergreen_pb2 as pb

CONFIG_INPUT = "config"
STATUS_OUTPUT = "__status__"


def leaf_id(node_id: str, seq: int) -> str:
    """The Evergreen leaf that holds chunk ``seq`` of an ActionEngine node."""
    return f"{node_id}[{seq}]"


def status_id(action_id: str) -> str:
    return f"{action_id}#{STATUS_OUTPUT}"


@dataclass(frozen=True, slots=True)
class Call:
    """One ActionEngine action, as the Evergreen session will run it."""

    id: str
    action: pb.Action
    outputs: tuple[str, ...]  # node ids the server writes
    config: str | None = None  # the node holding its GenerateConfig (JSON), if it has a config input


@dataclass(frozen=True, slots=True)
class Inbound:
    fragments: pb.SessionMessage
    calls: tuple[Call, ...]
    half_close: bool
    form: wire.Form


def inbound(frame: bytes, limits: wire.Limits, where: str) -> Inbound:
    """Decode one frame and translate it; any broken rule raises GatewayError."""
    message, form = wire.decode(frame, limits, where)
    out = pb.SessionMessage()
    for index, fragment in enumerate(message.fragments):
        _translate_fragment(fragment, f"{where} fragment {index}", out)
    calls = tuple(_call(action, f"{where} action {index}") for index, action in enumerate(message.actions))
    return Inbound(out, calls, message.is_half_close, form)


def _translate_fragment(fragment: wire.NodeFragment, where: str, out: pb.SessionMessage) -> None:
    if not fragment.id:
        raise invalid(f"{where}: a node fragment has no id")
    if fragment.seq is None:
        raise invalid(f"{where} (node {fragment.id!r}): seq must be set (0, 1, ...)")
    node = pb.NodeFragment(id=fragment.id, seq=fragment.seq, continued=fragment.continued)
    data = fragment.data
    if isinstance(data, wire.NodeRef):
        if data.offset or data.length is not None:
            raise invalid(f"{where}: a node ref to part of a node is not supported; refer to the whole node")
        node.child_ids.append(data.id)
        out.node_fragments.append(node)
        return
    if data.is_null:
        out.node_fragments.append(node)  # the end of the node
        return
    if data.metadata is not None and data.metadata.mimetype == wire.STATUS_MIMETYPE:
        raise invalid(f"{where}: a client does not write {wire.STATUS_MIMETYPE} chunks")
    leaf = leaf_id(fragment.id, fragment.seq)
    node.child_ids.append(leaf)
    chunk = pb.NodeFragment(id=leaf, seq=0, continued=False)
    if data.ref:
        chunk.chunk_fragment.ref = data.ref
    else:
        chunk.chunk_fragment.data = data.data
    if data.metadata is not None:
        chunk.chunk_fragment.metadata.mimetype = data.metadata.mimetype
        chunk.chunk_fragment.metadata.role = data.metadata.attributes.get("role", "")
    out.node_fragments.extend((node, chunk))


def _call(action: wire.ActionMessage, where: str) -> Call:
    if not action.id:
        raise invalid(f"{where}: an action has no id")
    out = pb.Action(name=action.name)
    config = None
    for port in action.inputs:
        if port.name == CONFIG_INPUT:
            if config is not None:
                raise invalid(f"{where}: input {CONFIG_INPUT!r} named twice")
            config = port.id
        else:
            out.inputs.add(name=port.name, id=port.id)
    for port in action.outputs:
        out.outputs.add(name=port.name, id=port.id)
    if any(p.id == status_id(action.id) for p in action.outputs):
        raise invalid(f"{where}: {status_id(action.id)!r} is the status node; it cannot be an output")
    return Call(action.id, out, tuple(p.id for p in action.outputs), config)


@dataclass(slots=True)
class _Output:
    action: str
    mimetype: str = ""
    role: str = ""
    next_seq: int = 0


@dataclass(slots=True)
class Writer:
    """The server's messages in ActionEngine's form, and each action's status when its outputs end."""

    form: wire.Form
    _outputs: dict[str, _Output] = field(default_factory=dict)  # output node id -> its state
    _open: dict[str, set[str]] = field(default_factory=dict)  # action id -> outputs not ended yet

    def track(self, call: Call) -> None:
        """An action the client sent: its outputs are written here, and its status after them."""
        self._open[call.id] = set(call.outputs)
        for node_id in call.outputs:
            self._outputs[node_id] = _Output(call.id)

    def encode(self, message: pb.SessionMessage) -> bytes | None:
        """One frame for a message of the session (None when it holds nothing for this client)."""
        fragments: list[bytes] = []
        for fragment in message.node_fragments:
            fragments.extend(self._fragment(fragment))
        return wire.encode(fragments, self.form) if fragments else None

    def _fragment(self, fragment: pb.NodeFragment) -> list[bytes]:
        output = self._outputs.get(fragment.id)
        if output is None:
            return []
        if fragment.HasField("chunk_fragment"):
            chunk = fragment.chunk_fragment
            if chunk.HasField("metadata"):
                output.mimetype, output.role = chunk.metadata.mimetype, chunk.metadata.role
            attributes = {"role": output.role} if output.role else {}
            data = wire.Chunk(chunk.data, "", wire.ChunkMetadata(output.mimetype, None, attributes))
        else:
            data = wire.Chunk(b"", "", wire.ChunkMetadata(wire.NULL_MIMETYPE))
        out = [wire.encode_fragment(wire.NodeFragment(fragment.id, data, fragment.seq, fragment.continued))]
        output.next_seq = fragment.seq + 1
        if not fragment.continued:
            out.extend(self._ended(output.action, fragment.id))
        return out

    def _ended(self, action: str, node_id: str) -> list[bytes]:
        waiting = self._open.get(action)
        if waiting is None:
            return []
        waiting.discard(node_id)
        if waiting:
            return []
        del self._open[action]
        return [_status_fragment(action, 0, "")]

    def failure(self, error: GatewayError) -> bytes | None:
        """The frame that tells every unfinished action why: the error on its open outputs, then its status.

        As the library's server does when a handler fails: a reader of any output, or of
        the status, ends with the error instead of waiting.
        """
        fragments: list[bytes] = []
        for action, waiting in self._open.items():
            for node_id in sorted(waiting):
                output = self._outputs[node_id]
                chunk = _status_chunk(int(error.code), error.message)
                fragments.append(wire.encode_fragment(wire.NodeFragment(node_id, chunk, output.next_seq, False)))
            fragments.append(_status_fragment(action, int(error.code), error.message))
        self._open.clear()
        return wire.encode(fragments, self.form) if fragments else None

    def half_close(self) -> bytes:
        """The empty message: this side sends nothing more."""
        return wire.encode([], self.form)


def _status_chunk(code: int, message: str) -> wire.Chunk:
    """absl::Status as a chunk: one byte of code, then the message (the library's converter)."""
    return wire.Chunk(bytes([code]) + message.encode(), "", wire.ChunkMetadata(wire.STATUS_MIMETYPE))


def _status_fragment(action: str, code: int, message: str) -> bytes:
    return wire.encode_fragment(wire.NodeFragment(status_id(action), _status_chunk(code, message), 0, False))
