"""Sessions in this process's memory: the default, for one gateway process."""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable

from prismgate.core.session import DEFAULT_TTL_S, Session
from prismgate.core.stores.base import SessionStore, busy, missing, over_token_cap, too_many


class InProcessStore(SessionStore):
    """Sessions in a dict; idle ones are evicted by :meth:`evict_expired` (or met expired on :meth:`get`)."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_sessions: int = 4096,
        max_total_tokens: int = 64 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(ttl_s=ttl_s, max_sessions=max_sessions, max_total_tokens=max_total_tokens)
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    @property
    def total_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values())

    async def create(self, model: str, *, pinned: bool = False, owner: str = "") -> Session:
        return self._add(Session(id=secrets.token_hex(16), model=model, pinned=pinned, owner=owner))

    async def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or self._expired(session):
            if session is not None:
                self._drop(session_id)
            raise missing(session_id)
        session.last_used = self._clock()
        return session

    async def fork(self, session_id: str, at_position: int, *, owner: str | None = None) -> Session:
        child = (await self.get(session_id)).forked(at_position, owner)
        await self.reserve(at_position)
        return self._add(child)

    async def owners(self) -> dict[str, str]:
        self._evict_now()
        return {sid: s.owner for sid, s in self._sessions.items()}

    async def close(self, session_id: str) -> bool:
        return self._drop(session_id)

    @contextlib.asynccontextmanager
    async def generation(self, session_id: str) -> AsyncIterator[Session]:
        session = await self.get(session_id)
        if session.busy:
            raise busy(session_id)
        session.busy = True
        try:
            yield session  # changed in place: nothing to save
        finally:
            session.busy = False
            session.last_used = self._clock()

    async def reserve(self, extra_tokens: int) -> None:
        total = self.total_tokens
        if extra_tokens > 0 and total + extra_tokens > self.max_total_tokens:
            raise over_token_cap(total, extra_tokens, self.max_total_tokens)

    async def evict_expired(self) -> list[str]:
        return self._evict_now()

    async def close_all(self) -> int:
        ids = list(self._sessions)
        for session_id in ids:
            self._drop(session_id)
        return len(ids)

    def _add(self, session: Session) -> Session:
        self._evict_now()
        if len(self._sessions) >= self.max_sessions:
            raise too_many(self.max_sessions)
        session.ttl_s = self.ttl_s
        session.last_used = self._clock()
        self._sessions[session.id] = session
        return session

    def _evict_now(self) -> list[str]:
        expired = [sid for sid, s in self._sessions.items() if self._expired(s)]
        for sid in expired:
            self._drop(sid)
        return expired

    def _expired(self, session: Session) -> bool:
        return not (session.busy or session.pinned) and self._clock() - session.last_used > session.ttl_s

    def _drop(self, session_id: str) -> bool:
        if self._sessions.pop(session_id, None) is None:
            return False
        self._released(session_id)
        return True
