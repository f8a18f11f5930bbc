"""A GENERATE input tree -> chat messages (for :mod:`prismgate.core.chat` to render).

The tree is flattened to its leaves in order; each leaf is one chunk (its fragments'
payloads concatenated: chunk boundaries carry no meaning). Then:

* ``text/*`` chunks become message text under their ``role`` (default ``user``;
  ``model`` means ``assistant``); consecutive chunks of the same role join into one message;
* ``image/*`` chunks become image parts of the current message (the model must see images);
* a chunk ``application/x-protobuf; type=EndOfTurn`` (no payload) ends the current turn,
  so the next chunk starts a new message even under the same role;
* text this server generated keeps its exact token ids (for prefix reuse).
"""

from __future__ import annotations

from dataclasses import dataclass

from prismgate.codecs.evergreen.nodes import NodeStore
from prismgate.codecs.evergreen.payloads import RefPolicy, payload
from prismgate.core.chat import ImagePart, Message, TextPart, normalize_role
from prismgate.core.errors import invalid

END_OF_TURN = "application/x-protobuf; type=EndOfTurn"


@dataclass(frozen=True, slots=True)
class Mime:
    """A parsed mimetype: ``type/subtype`` lowercased plus its parameters."""

    essence: str
    params: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Mime:
        head, *rest = text.split(";")
        params = {}
        for item in rest:
            key, _, value = item.partition("=")
            params[key.strip().lower()] = value.strip().strip('"')
        return cls(head.strip().lower(), params)

    @property
    def end_of_turn(self) -> bool:
        return self.essence == "application/x-protobuf" and self.params.get("type") == "EndOfTurn"


async def messages_from_tree(store: NodeStore, root: str, policy: RefPolicy) -> list[Message]:
    messages: list[Message] = []
    open_turn = False  # whether the last message may still grow
    for leaf in list(store.leaves(root)):
        assert leaf.metadata is not None
        mime = Mime.parse(leaf.metadata.mimetype)
        where = f"node {leaf.id!r} ({leaf.metadata.mimetype or 'no mimetype'})"
        if mime.end_of_turn:
            if any(c.WhichOneof("payload") is not None and (c.data or c.ref) for c in leaf.chunks()):
                raise invalid(f"{where}: an EndOfTurn chunk carries no payload")
            open_turn = False
            continue
        role = normalize_role(leaf.metadata.role)
        data = b"".join([await payload(c, policy, where) for c in leaf.chunks()])
        if mime.essence.startswith("text/"):
            charset = mime.params.get("charset", "utf-8")
            try:
                text = data.decode(charset)
            except (LookupError, UnicodeDecodeError) as exc:
                raise invalid(f"{where}: text is not valid {charset}: {exc}") from None
            part: TextPart | ImagePart = TextPart(text, tuple(leaf.tokens) if leaf.tokens is not None else None)
        elif mime.essence.startswith("image/"):
            if not data:
                raise invalid(f"{where}: image chunk has no data")
            part = ImagePart(data, mime.essence)
        else:
            raise invalid(f"{where}: GENERATE takes text/*, image/* and EndOfTurn chunks, not {mime.essence!r}")
        if open_turn and messages and messages[-1].role == role:
            messages[-1].parts.append(part)
        else:
            messages.append(Message(role, [part]))
        open_turn = True
    if not messages:
        raise invalid(f"input {root!r} holds no text or image chunks")
    return messages
