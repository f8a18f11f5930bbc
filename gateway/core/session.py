"""Sessions: a token timeline with images, owned by one client at a time.

A session is the server-side copy of a conversation so that clients send deltas
instead of whole prompts. The store enforces the limits that keep a shared server
alive: idle eviction, a cap on the number of sessions and on the tokens they hold.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prismgate.core.errors import Code, GatewayError, exhausted, invalid, not_found, precondition
from prismgate.core.steering import SteeredSpan, clip

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

    def truncate(self, length: int) -> None:
        self.check_boundary(length, "truncation")
        del self.tokens[length:]
        self.images = [im for im in self.images if im.end <= length]
        self.steering = clip(self.steering, length)

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """Hold the session for one generation; a concurrent second one is ABORTED."""
        if self.busy:
            raise GatewayError(Code.ABORTED, f"session {self.id} is busy with another generation")
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


class SessionStore:
    """Sessions by id, with idle eviction and capacity limits.

    ``on_release`` is told the id of every session that goes away (closed or evicted)
    so that engines can drop caches keyed on it.
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_sessions: int = 4096,
        max_total_tokens: int = 64 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise invalid(f"session TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_total_tokens = max_total_tokens
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._listeners: list[Callable[[str], None]] = []

    def on_release(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    @property
    def total_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values())

    def create(self, model: str, tokens: list[int] | None = None) -> Session:
        self.evict_expired()
        if len(self._sessions) >= self.max_sessions:
            raise exhausted(f"too many open sessions (limit {self.max_sessions}); close some first")
        tokens = list(tokens or [])
        self.reserve(len(tokens))
        session = Session(
            id=secrets.token_hex(16),
            model=model,
            tokens=tokens,
            ttl_s=self.ttl_s,
            last_used=self._clock(),
        )
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or self._expired(session):
            if session is not None:
                self._drop(session_id)
            raise not_found(f"session {session_id!r} does not exist (closed, evicted after idling, or never opened)")
        session.last_used = self._clock()
        return session

    def close(self, session_id: str) -> bool:
        """Release a session. Closing an unknown or already closed session is not an error."""
        return self._drop(session_id)

    def close_all(self) -> int:
        """Release every session (at shutdown), so engines drop their caches cleanly."""
        ids = list(self._sessions)
        for session_id in ids:
            self._drop(session_id)
        return len(ids)

    def fork(self, session_id: str, at_position: int) -> Session:
        source = self.get(session_id)
        source.check_boundary(at_position, "fork")
        child = self.create(source.model, source.tokens[:at_position])
        child.images = [im for im in source.images if im.end <= at_position]
        child.steering = clip(source.steering, at_position)
        return child

    def reserve(self, extra_tokens: int) -> None:
        """Check that ``extra_tokens`` more tokens fit under the store-wide cap."""
        total = self.total_tokens
        if extra_tokens > 0 and total + extra_tokens > self.max_total_tokens:
            raise exhausted(
                f"the server holds {total} session tokens and {extra_tokens} more would pass "
                f"its limit of {self.max_total_tokens}"
            )

    def evict_expired(self) -> list[str]:
        expired = [sid for sid, s in self._sessions.items() if self._expired(s)]
        for sid in expired:
            self._drop(sid)
        return expired

    def touch(self, session: Session) -> None:
        session.last_used = self._clock()

    def _expired(self, session: Session) -> bool:
        return not (session.busy or session.pinned) and self._clock() - session.last_used > session.ttl_s

    def _drop(self, session_id: str) -> bool:
        if self._sessions.pop(session_id, None) is None:
            return False
        for listener in self._listeners:
            listener(session_id)
        return True
