"""A key's limits counted in Redis, so that every gateway replica enforces one limit.

Two keys per named key under the store's prefix: ``q:<name>:run`` (a sorted set of the
running generations' request ids, scored by when their lease runs out) and
``q:<name>:<window>`` (the tokens used in that one-minute window, expiring after two).
Admission is one Lua script (check the rate, drop expired leases, count, add), so two
replicas admitting at the same moment cannot both take the last slot. A live
generation renews its lease; a replica that dies holding leases frees them when they
run out (``LEASE_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions

from prismgate.core.errors import Code, GatewayError
from prismgate.core.principal import Principal
from prismgate.core.quota import WINDOW_S, Quota, over_concurrency, over_rate, window

LEASE_S = 30.0

# KEYS: running set, window counter. ARGV: now_ms, lease_until_ms, request id, max_concurrent,
# tokens_per_minute. Returns {1, 0} admitted, {0, used} over the rate, {-1, 0} over concurrency.
_ADMIT = """
local rate = tonumber(ARGV[5])
if rate > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used >= rate then return {0, used} end
end
local most = tonumber(ARGV[4])
if most > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  if redis.call('ZCARD', KEYS[1]) >= most then return {-1, 0} end
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) - tonumber(ARGV[1]))
end
return {1, 0}
"""

# KEYS: window counter. ARGV: tokens, expiry_ms.
_CHARGE = """
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class RedisQuota(Quota):
    """Per-key limits in the Redis at ``url``, shared by every replica using the same ``prefix``."""

    def __init__(self, url: str, *, prefix: str = "prismgate:", timeout_s: float = 5.0) -> None:
        self._prefix = prefix
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._admit = self._redis.register_script(_ADMIT)
        self._charge = self._redis.register_script(_CHARGE)
        self._renewals: dict[str, asyncio.Task[None]] = {}

    def _keys(self, name: str, now: float) -> list[str]:
        base = f"{self._prefix}q:{name}"
        return [base + ":run", f"{base}:{window(now)[0]}"]

    async def admit(self, principal: Principal, request_id: str) -> None:
        if not (principal.max_concurrent or principal.tokens_per_minute):
            return
        now = time.time()
        args: list[int | str] = [int(now * 1000), int((now + LEASE_S) * 1000), request_id]
        args += [principal.max_concurrent, principal.tokens_per_minute]
        admitted, used = await _guarded(self._admit(keys=self._keys(principal.name, now), args=args))
        if admitted == 0:
            raise over_rate(principal, int(used), window(now)[1])
        if admitted == -1:
            raise over_concurrency(principal)
        if principal.max_concurrent:
            self._renewals[request_id] = asyncio.create_task(self._renew(principal.name, request_id))

    async def _renew(self, name: str, request_id: str) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            with contextlib.suppress(GatewayError):
                until = int((time.time() + LEASE_S) * 1000)
                await _guarded(self._redis.zadd(self._keys(name, 0)[0], {request_id: until}, xx=True))

    async def release(self, principal: Principal, request_id: str) -> None:
        renewal = self._renewals.pop(request_id, None)
        if renewal is None:
            return
        renewal.cancel()
        await _guarded(self._redis.zrem(self._keys(principal.name, 0)[0], request_id))

    async def charge(self, principal: Principal, tokens: int) -> None:
        if principal.tokens_per_minute and tokens > 0:
            key = self._keys(principal.name, time.time())[1]
            await _guarded(self._charge(keys=[key], args=[tokens, int(2 * WINDOW_S * 1000)]))

    async def close(self) -> None:
        for task in self._renewals.values():
            task.cancel()
        await self._redis.aclose()


async def _guarded(call: Awaitable[Any]) -> Any:
    """Redis down is UNAVAILABLE, as for the session store."""
    try:
        return await call
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise GatewayError(Code.UNAVAILABLE, f"the quota store (Redis) is unreachable: {exc}; retry later") from None
