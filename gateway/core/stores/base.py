"""The session store interface the core talks to.

Every method is a coroutine so that a store across the network (Redis) never blocks the
event loop; the in-process store simply answers at once. A store hands out
:class:`~prismgate.core.session.Session` values: for a shared store they are copies, so
the only way to change a stored timeline is a generation (:meth:`SessionStore.generation`),
which holds the session exclusively and saves what it leaves behind.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from prismgate.core.errors import Code, GatewayError, exhausted, invalid, not_found, quote
from prismgate.core.session import DEFAULT_TTL_S, Session

SESSION_ID = re.compile(r"[0-9a-f]{32}")
"""What every store's ids look like (``secrets.token_hex(16)``): anything else names no session."""


def well_formed(session_id: str) -> bool:
    """Whether ``session_id`` could name a session; a shared store checks before building keys from it.

    In Redis a session's keys are ``s:<id>``, ``s:<id>:img`` and ``s:<id>:lock``: an id of
    ``<S>:lock`` would name another session's lock (WRONGTYPE, an internal error).
    """
    return SESSION_ID.fullmatch(session_id) is not None


def busy(session_id: str) -> GatewayError:
    """ABORTED: one generation per session, wherever the other one runs."""
    return GatewayError(Code.ABORTED, f"session {quote(session_id)} is busy with another generation")


def missing(session_id: str) -> GatewayError:
    return not_found(f"session {quote(session_id)} does not exist (closed, evicted after idling, or never opened)")


def too_many(limit: int) -> GatewayError:
    return exhausted(f"too many open sessions (limit {limit}); close some first")


def over_token_cap(total: int, extra: int, limit: int) -> GatewayError:
    return exhausted(f"the server holds {total} session tokens and {extra} more would pass its limit of {limit}")


class SessionStore(abc.ABC):
    """Sessions by id, with idle expiry and capacity limits.

    ``on_release`` listeners are told the id of every session this process lets go
    (closed, expired, or left at shutdown) so that engines can drop caches keyed on it.
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_sessions: int = 4096,
        max_total_tokens: int = 64 * 1024 * 1024,
    ) -> None:
        if ttl_s <= 0:
            raise invalid(f"session TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_total_tokens = max_total_tokens
        self._listeners: list[Callable[[str], None]] = []

    def on_release(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def _released(self, session_id: str) -> None:
        for listener in self._listeners:
            listener(session_id)

    # -- what metrics read (synchronously, between scrapes) -------------------------------

    @abc.abstractmethod
    def __len__(self) -> int:
        """Open sessions (a shared store: as of its last :meth:`evict_expired`)."""

    @property
    @abc.abstractmethod
    def total_tokens(self) -> int:
        """Tokens held by all sessions (a shared store: as of its last :meth:`evict_expired`)."""

    # -- sessions -------------------------------------------------------------------------

    @abc.abstractmethod
    async def create(self, model: str, *, pinned: bool = False, owner: str = "") -> Session:
        """A new empty session; ``pinned``: kept while its connection is open, not evicted for idling;
        ``owner``: the name of the key that opens it."""

    @abc.abstractmethod
    async def get(self, session_id: str) -> Session:
        """The session (NOT_FOUND when closed, expired or unknown); counts as a use for idle expiry."""

    @abc.abstractmethod
    async def fork(self, session_id: str, at_position: int, *, owner: str | None = None) -> Session:
        """A new session holding the first ``at_position`` tokens of another, its images included;
        ``owner``: the child's (None: the parent's)."""

    @abc.abstractmethod
    async def owners(self) -> dict[str, str]:
        """Every open session's owner by session id (for an admin's listing)."""

    @abc.abstractmethod
    async def close(self, session_id: str) -> bool:
        """Release a session. Closing an unknown or already closed session is not an error."""

    @abc.abstractmethod
    def generation(self, session_id: str) -> AbstractAsyncContextManager[Session]:
        """Hold the session for one generation; a concurrent second one is ABORTED.

        The body may change the session's timeline; what it leaves is saved on exit (also
        when the body raises: the core restores the turn's snapshot first).
        """

    async def unreachable(self) -> str | None:
        """Why the store cannot serve sessions now, or None when it can (readiness asks).

        A store in this process always can; a store across the network says so when it is down.
        """
        return None

    @abc.abstractmethod
    async def reserve(self, extra_tokens: int) -> None:
        """RESOURCE_EXHAUSTED unless ``extra_tokens`` more tokens fit under the store-wide cap."""

    @abc.abstractmethod
    async def evict_expired(self) -> list[str]:
        """Drop idle sessions past their TTL (a shared store: refresh the counts metrics read)."""

    @abc.abstractmethod
    async def close_all(self) -> int:
        """At shutdown: let go of every session this process holds; returns how many.

        The in-process store closes them. A shared store keeps them for the other replicas
        and a restart: only this process's caches are released.
        """
