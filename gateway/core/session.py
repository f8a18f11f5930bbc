"""Sessions: a token timeline with images, owned by one client at a time.

A session is the server-side copy of a conversation so that clients send deltas
instead of whole prompts. Where sessions are kept, and the limits that keep a shared
server alive (idle expiry, caps on sessions and tokens), is a store's job:
:mod:`prismgate.core.stores`.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field

from prismgate.core.errors import precondition
from prismgate.core.steering import SteeredSpan, Steering, clip

DEFAULT_TTL_S = 30 * 60


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image placed at ``[start, end)``: its whole vision block, start and end markers included."""

    start: int
    end: int
    data: bytes
    mime: str
    digest: str

    @classmethod
    def of(cls, start: int, end: int, data: bytes, mime: str) -> ImageSpan:
        return cls(start, end, data, mime, hashlib.sha256(data).hexdigest())

    def splits_at(self, position: int) -> bool:
        """True when cutting the timeline before ``position`` would cut this block in two."""
        return self.start < position < self.end


@dataclass(slots=True)
class Session:
    id: str
    model: str
    tokens: list[int] = field(default_factory=list)
    images: list[ImageSpan] = field(default_factory=list)
    ttl_s: float = DEFAULT_TTL_S
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False
    pinned: bool = False  # kept alive by an open connection (Evergreen): never evicted for idling
    steering: tuple[SteeredSpan, ...] = ()  # the steering each span was last computed under (core.steering)
    # what a generation on this session steers with when its own spec names no steering
    # (set by salience.steering.v1; see SessionService.set_steering)
    standing_steering: Steering = ()
    owner: str = ""  # the name of the key that opened it (prismgate.core.principal); "" without keys

    def __len__(self) -> int:
        return len(self.tokens)

    def check_boundary(self, position: int, what: str) -> None:
        """Reject positions past the end or inside an image block."""
        if position > len(self.tokens):
            raise precondition(f"{what} position {position} is past the session length {len(self.tokens)}")
        for image in self.images:
            if image.splits_at(position):
                raise precondition(
                    f"{what} position {position} falls inside the image block "
                    f"[{image.start}, {image.end}); pick {image.start} or {image.end}"
                )

    def snapshot(self) -> tuple[list[int], list[ImageSpan]]:
        """The timeline as it is now, for :meth:`restore` (turn atomicity)."""
        return list(self.tokens), list(self.images)

    def restore(self, snapshot: tuple[list[int], list[ImageSpan]]) -> None:
        self.tokens, self.images = list(snapshot[0]), list(snapshot[1])

    def forked(self, at_position: int, owner: str | None = None) -> Session:
        """A new session (new id) holding this one's first ``at_position`` tokens, whole images and steering.

        The child inherits the standing steering too: a fork continues the same conversation,
        so its next turn is steered as the parent's would be until the child sets its own.
        ``owner``: the key the child belongs to (None: the parent's).
        """
        self.check_boundary(at_position, "fork")
        return Session(
            id=secrets.token_hex(16),
            model=self.model,
            tokens=self.tokens[:at_position],
            images=[im for im in self.images if im.end <= at_position],
            steering=clip(self.steering, at_position),
            standing_steering=self.standing_steering,
            owner=self.owner if owner is None else owner,
        )

    def truncate(self, length: int) -> None:
        self.check_boundary(length, "truncation")
        del self.tokens[length:]
        self.images = [im for im in self.images if im.end <= length]
        self.steering = clip(self.steering, length)
