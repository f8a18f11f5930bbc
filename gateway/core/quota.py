"""A key's limits: generations at once and tokens per minute, checked before the work.

* **Concurrency**: a key holds one lease per running generation; a generation that would
  pass ``max_concurrent`` is refused RESOURCE_EXHAUSTED (retry after a second: a slot
  frees when one of its own generations ends).
* **Token rate**: what a key used (prompt plus generated tokens, as each generation's
  usage reports them) is counted in fixed one-minute windows; once a window holds
  ``tokens_per_minute``, the key's next generations are refused until the window ends,
  and the refusal says when that is. The generation that crosses the line finishes:
  the check is before the work, the count after it.

:class:`LocalQuota` keeps the counts in this process; with the Redis session store the
gateway uses :class:`~prismgate.core.stores.redis_quota.RedisQuota`, so every replica
counts against one limit.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable

from prismgate.core.errors import GatewayError, retry_later
from prismgate.core.principal import Principal

WINDOW_S = 60.0
CONCURRENCY_RETRY_S = 1.0


def over_concurrency(principal: Principal) -> GatewayError:
    return retry_later(
        f"key {principal.name!r} already runs {principal.max_concurrent} generations (its max_concurrent)",
        CONCURRENCY_RETRY_S,
    )


def over_rate(principal: Principal, used: int, retry_after_s: float) -> GatewayError:
    return retry_later(
        f"key {principal.name!r} used {used} tokens this minute (its tokens_per_minute is "
        f"{principal.tokens_per_minute})",
        retry_after_s,
    )


def window(now: float) -> tuple[int, float]:
    """The one-minute window ``now`` falls in, and the seconds until it ends."""
    index = int(now // WINDOW_S)
    return index, (index + 1) * WINDOW_S - now


class Quota(abc.ABC):
    """Per-key limits; a principal with no limits passes without a count."""

    @abc.abstractmethod
    async def admit(self, principal: Principal, request_id: str) -> None:
        """RESOURCE_EXHAUSTED (with a retry hint) when the key is at a limit; else hold a lease for ``request_id``."""

    @abc.abstractmethod
    async def release(self, principal: Principal, request_id: str) -> None:
        """The generation ``request_id`` ended: its lease is free."""

    @abc.abstractmethod
    async def charge(self, principal: Principal, tokens: int) -> None:
        """Count ``tokens`` against the key's rate in the current window."""

    async def close(self) -> None:  # noqa: B027 (a local quota holds nothing to close)
        """Let go of connections (a shared quota)."""


class LocalQuota(Quota):
    """Counts in this process."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._running: dict[str, set[str]] = {}
        self._used: dict[str, tuple[int, int]] = {}  # key -> (window, tokens used in it)

    def used(self, name: str) -> int:
        """Tokens ``name`` used in the current window."""
        index, _ = window(self._clock())
        held = self._used.get(name)
        return held[1] if held is not None and held[0] == index else 0

    async def admit(self, principal: Principal, request_id: str) -> None:
        if principal.tokens_per_minute:
            used = self.used(principal.name)
            if used >= principal.tokens_per_minute:
                raise over_rate(principal, used, window(self._clock())[1])
        if principal.max_concurrent:
            running = self._running.setdefault(principal.name, set())
            if len(running) >= principal.max_concurrent:
                raise over_concurrency(principal)
            running.add(request_id)

    async def release(self, principal: Principal, request_id: str) -> None:
        running = self._running.get(principal.name)
        if running is not None:
            running.discard(request_id)
            if not running:
                del self._running[principal.name]

    async def charge(self, principal: Principal, tokens: int) -> None:
        if principal.tokens_per_minute and tokens > 0:
            index, _ = window(self._clock())
            self._used[principal.name] = (index, self.used(principal.name) + tokens)
