"""Sessions in Redis: shared by every gateway replica and kept across restarts.

A session is three keys under the store's prefix: ``s:<id>`` (a hash: model, owning key, tokens
as little-endian int32, image spans, steering record and standing steering as JSON),
``s:<id>:img`` (image bytes by SHA-256) and, while a generation runs, ``s:<id>:lock`` (a random
token with an expiry); idle expiry is Redis's own, refreshed by every use. ``sessions`` (ids by
expiry) and ``lengths`` (token counts) serve the store-wide limits and metrics. Every change
that must hold across replicas is one Lua script (docs/scaling.md): a save whose lock expired
gets ABORTED, never a wrong timeline. KV caches stay per process: a replica prefills again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions

from prismgate.core import steering
from prismgate.core.errors import Code, GatewayError, exhausted
from prismgate.core.session import DEFAULT_TTL_S, ImageSpan, Session
from prismgate.core.steering import SteeredSpan, Steering
from prismgate.core.stores.base import SessionStore, busy, missing, over_token_cap, too_many, well_formed

T = TypeVar("T")
READINESS_EVERY_S = 1.0  # /readyz asks Redis at most this often; between PINGs it repeats the last answer

# KEYS: session, images, sessions, lengths. ARGV: id, now_ms, ttl_ms, max_sessions, model,
# tokens, spans, token_count, owner, then digest/bytes pairs. Returns 0 when the cap is reached.
_CREATE = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[2])
for _, sid in ipairs(gone) do redis.call('HDEL', KEYS[4], sid) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[1], 'model', ARGV[5], 'tokens', ARGV[6], 'spans', ARGV[7], 'owner', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if #ARGV > 9 then
  for i = 10, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
redis.call('ZADD', KEYS[3], tonumber(ARGV[2]) + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[8])
return 1
"""

# KEYS: session, images, lock, sessions. ARGV: id, ttl_ms, expires_at_ms.
# Returns nil for a missing session, else {model, tokens, spans, busy, owner, digest, bytes, ...}.
_LOAD = """
local fields = redis.call('HMGET', KEYS[1], 'model', 'tokens', 'spans', 'owner')
if not fields[1] then return nil end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
local out = {fields[1], fields[2], fields[3], redis.call('EXISTS', KEYS[3]), fields[4] or ''}
for _, v in ipairs(redis.call('HGETALL', KEYS[2])) do out[#out + 1] = v end
return out
"""

# KEYS: session, images, lock, sessions. ARGV: lock token, lock_ms, ttl_ms, expires_at_ms, id.
_RENEW = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[3], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[4], 'XX', ARGV[4], ARGV[5])
return 1
"""

# KEYS: session, images, lock, sessions, lengths. ARGV: lock token, id, ttl_ms, expires_at_ms,
# tokens, spans, token_count, number of new images n, n digest/bytes pairs, digests to drop.
# Returns -1 when the lock is no longer ours, 0 when the session was closed meanwhile, 1 saved.
_SAVE = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[3])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'tokens', ARGV[5], 'spans', ARGV[6])
local n = tonumber(ARGV[8])
for i = 9, 8 + 2 * n, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
for i = 9 + 2 * n, #ARGV do redis.call('HDEL', KEYS[2], ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[2])
redis.call('HSET', KEYS[5], ARGV[2], ARGV[7])
return 1
"""

# KEYS: lock. ARGV: lock token.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: sessions, lengths. ARGV: now_ms. Drops index entries past their expiry, then
# returns {session count, token total}.
_COUNT = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, sid in ipairs(gone) do redis.call('HDEL', KEYS[2], sid) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(v) end
return {redis.call('ZCARD', KEYS[1]), total}
"""


def _pack(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _unpack(raw: bytes) -> list[int]:
    return np.frombuffer(raw, dtype="<i4").tolist()


def _spans(session: Session) -> str:
    """Where the images sit, which steering each span was computed under, and the standing steering."""
    return json.dumps(
        {
            "images": [[im.start, im.end, im.mime, im.digest] for im in session.images],
            "steering": [[sp.start, sp.end, sp.digest] for sp in session.steering],
            "standing": [steering.to_json(e) for e in session.standing_steering],
        }
    )


def _standing(rows: list[list[Any]]) -> Steering:
    return tuple(steering.from_json(row) for row in rows)


class RedisStore(SessionStore):
    """Sessions in a Redis server at ``url`` (``redis://host:port/db``), shared by every replica.

    ``lock_s`` bounds how long a replica that died mid-generation keeps its session
    busy; a live generation renews its lock every third of it.
    """

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_sessions: int = 4096,
        max_total_tokens: int = 64 * 1024 * 1024,
        lock_s: float = 10.0,
        prefix: str = "prismgate:",
        timeout_s: float = 5.0,
    ) -> None:
        super().__init__(ttl_s=ttl_s, max_sessions=max_sessions, max_total_tokens=max_total_tokens)
        self.url = url
        self.lock_s = lock_s
        self._prefix = prefix
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=False
        )
        self._scripts = {
            name: self._redis.register_script(body)
            for name, body in {
                "create": _CREATE,
                "load": _LOAD,
                "renew": _RENEW,
                "save": _SAVE,
                "unlock": _UNLOCK,
                "count": _COUNT,
            }.items()
        }
        self._count = 0
        self._tokens = 0
        self._checked_at = -READINESS_EVERY_S
        self._down: str | None = None

    def __len__(self) -> int:
        return self._count

    @property
    def total_tokens(self) -> int:
        return self._tokens

    # -- keys and clocks --------------------------------------------------------------------

    def _keys(self, session_id: str) -> list[str]:
        """session, images, lock, sessions index, lengths; NOT_FOUND for an id no session can have."""
        if not well_formed(session_id):
            raise missing(session_id)
        base = f"{self._prefix}s:{session_id}"
        return [base, base + ":img", base + ":lock", self._prefix + "sessions", self._prefix + "lengths"]

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    def _expires_at(self) -> int:
        return int(time.time() * 1000) + self._ttl_ms

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._guarded(self._scripts[name](keys=keys, args=args))

    async def _guarded(self, call: Awaitable[T]) -> T:
        """Redis's failures as the core's errors: down is UNAVAILABLE, full is RESOURCE_EXHAUSTED."""
        try:
            return await call
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise GatewayError(
                Code.UNAVAILABLE, f"the session store (Redis) is unreachable: {exc}; retry later"
            ) from None
        except redis.exceptions.ResponseError as exc:
            if str(exc).startswith("OOM"):
                raise exhausted(f"the session store (Redis) is full: {exc}") from None
            raise GatewayError(Code.INTERNAL, f"the session store (Redis) refused a command: {exc}") from None

    # -- sessions ---------------------------------------------------------------------------

    async def create(self, model: str, *, pinned: bool = False, owner: str = "") -> Session:
        # ``pinned`` (an open Evergreen connection) needs no special case here: each of the
        # connection's generations renews the expiry, and a dead gateway's sessions must expire
        return await self._create(Session(id=secrets.token_hex(16), model=model, owner=owner))

    async def _create(self, session: Session) -> Session:
        pairs: list[Any] = []
        for image in {im.digest: im for im in session.images}.values():
            pairs += [image.digest, image.data]
        keys = self._keys(session.id)
        args = [
            session.id, int(time.time() * 1000), self._ttl_ms, self.max_sessions, session.model,
            _pack(session.tokens), _spans(session), len(session.tokens), session.owner, *pairs,
        ]  # fmt: skip
        if not await self._call("create", [keys[0], keys[1], keys[3], keys[4]], args):
            raise too_many(self.max_sessions)
        session.ttl_s = self.ttl_s
        return session

    async def get(self, session_id: str) -> Session:
        keys = self._keys(session_id)
        found = await self._call("load", keys[:4], [session_id, self._ttl_ms, self._expires_at()])
        if found is None:
            raise missing(session_id)
        model, tokens, spans, locked, owner, *images = found
        data = dict(zip(images[0::2], images[1::2], strict=True))
        layout = json.loads(spans)
        return Session(
            id=session_id,
            model=model.decode(),
            tokens=_unpack(tokens),
            images=[
                ImageSpan(start, end, data[digest.encode()], mime, digest)
                for start, end, mime, digest in layout["images"]
            ],
            ttl_s=self.ttl_s,
            busy=bool(locked),
            steering=tuple(SteeredSpan(start, end, digest) for start, end, digest in layout["steering"]),
            standing_steering=_standing(layout.get("standing", [])),  # absent: saved before it existed
            owner=owner.decode(),
        )

    async def fork(self, session_id: str, at_position: int, *, owner: str | None = None) -> Session:
        child = (await self.get(session_id)).forked(at_position, owner)
        await self.reserve(at_position)
        return await self._create(child)

    async def owners(self) -> dict[str, str]:
        await self._refresh()  # drops index entries past their expiry
        found = await self._guarded(self._redis.zrange(self._prefix + "sessions", 0, -1))  # the sessions index
        ids = [sid.decode() for sid in found if isinstance(sid, bytes)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hmget(self._keys(sid)[0], "model", "owner")
            rows = await self._guarded(pipe.execute())
        return {sid: (owner or b"").decode() for sid, (model, owner) in zip(ids, rows, strict=True) if model}

    async def close(self, session_id: str) -> bool:
        if not well_formed(session_id):
            return False  # closing an unknown session is not an error
        keys = self._keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys[0], keys[1])
            pipe.zrem(keys[3], session_id)
            pipe.hdel(keys[4], session_id)
            deleted, _, _ = await self._guarded(pipe.execute())
        self._released(session_id)
        return bool(deleted)

    @contextlib.asynccontextmanager
    async def generation(self, session_id: str) -> AsyncIterator[Session]:
        keys = self._keys(session_id)
        token = secrets.token_hex(16)
        lock_ms = int(self.lock_s * 1000)
        if not await self._guarded(self._redis.set(keys[2], token, nx=True, px=lock_ms)):
            raise busy(session_id)
        saved = False
        try:
            session = await self.get(session_id)
            before = (session.snapshot(), session.steering, session.standing_steering)
            renewing = asyncio.create_task(self._renew(session_id, token))
            try:
                yield session
            finally:
                renewing.cancel()
                saved = True  # from here the save releases the lock, even if this task is cancelled
                # shielded: a cancelled request still saves (or releases) before the lock expires
                await asyncio.shield(self._save(session, token, before))
        finally:
            if not saved:
                with contextlib.suppress(GatewayError):
                    await asyncio.shield(self._call("unlock", [keys[2]], [token]))

    async def _renew(self, session_id: str, token: str) -> None:
        keys = self._keys(session_id)
        lock_ms = int(self.lock_s * 1000)
        while True:
            await asyncio.sleep(self.lock_s / 3)
            with contextlib.suppress(GatewayError):  # the save finds out whether the lock held
                await self._call("renew", keys[:4], [token, lock_ms, self._ttl_ms, self._expires_at(), session_id])

    async def _save(
        self,
        session: Session,
        token: str,
        before: tuple[tuple[list[int], list[ImageSpan]], tuple[SteeredSpan, ...], Steering],
    ) -> None:
        keys = self._keys(session.id)
        (tokens_before, images_before), steering_before, standing_before = before
        now = (session.tokens, session.images, session.steering, session.standing_steering)
        if now == (tokens_before, images_before, steering_before, standing_before):
            await self._call("unlock", [keys[2]], [token])
            return
        stored = {im.digest for im in images_before}
        kept = {im.digest: im for im in session.images}
        added: list[Any] = []
        for digest, image in kept.items():
            if digest not in stored:
                added += [digest, image.data]
        dropped = sorted(stored - kept.keys())
        args = [
            token, session.id, self._ttl_ms, self._expires_at(), _pack(session.tokens), _spans(session),
            len(session.tokens), len(added) // 2, *added, *dropped,
        ]  # fmt: skip
        if await self._call("save", keys, args) == -1:
            raise GatewayError(
                Code.ABORTED,
                f"session {session.id}: this generation held the session longer than its lock "
                f"({self.lock_s} s) without renewing it; its result was not saved",
            )

    async def reserve(self, extra_tokens: int) -> None:
        if extra_tokens <= 0:
            return
        await self._refresh()
        if self._tokens + extra_tokens > self.max_total_tokens:
            raise over_token_cap(self._tokens, extra_tokens, self.max_total_tokens)

    async def unreachable(self) -> str | None:
        """A PING, at most one every :data:`READINESS_EVERY_S` (a flood of probes is not a flood of PINGs)."""
        now = time.monotonic()
        if now - self._checked_at >= READINESS_EVERY_S:
            self._checked_at = now
            try:
                await self._guarded(self._redis.ping())
                self._down = None
            except GatewayError as exc:
                self._down = exc.message
        return self._down

    async def evict_expired(self) -> list[str]:
        await self._refresh()  # Redis expires the sessions themselves
        return []

    async def _refresh(self) -> None:
        keys = [self._prefix + "sessions", self._prefix + "lengths"]
        self._count, self._tokens = await self._call("count", keys, [int(time.time() * 1000)])

    async def close_all(self) -> int:
        await self._redis.aclose()  # the sessions stay in Redis for the other replicas and a restart
        return 0
