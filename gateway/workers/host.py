"""The engine host: the one process that runs the engines for every front-end process.

It builds the served models' engines exactly as a single-process server does
(:func:`prismgate.compose.build_engine`: transformers, or vLLM with its ``AsyncLLM`` here),
and the one :class:`~prismgate.core.pool.EnginePool` over them, so admission
(``max_active``, ``max_queued``), each key's fair share, the memory budget and the
replicas' session affinity are decided in one place, for all front-ends together. With
``session_store = "memory"`` it also holds the sessions (an
:class:`~prismgate.core.stores.InProcessStore`) and the per-key quota counts
(:class:`~prismgate.core.quota.LocalQuota`), so a session opened through one front-end
continues on any other and a key's limits count every process's requests. With a Redis
store the front-ends use Redis directly, as separate replicas do.

It serves them over a Unix socket (:mod:`prismgate.workers.wire`). Messages in:

* ``("gen", id, model, EngineRequest, Share)``: stream ``("ev", id, event)`` messages,
  then ``("end", id)`` or ``("err", id, error)``; ``("cancel", id)`` closes the stream
  (the engine cancels the request, as when an in-process consumer goes away);
* ``("call", id, target, method, args)``: one call on the store, the quota or an engine,
  answered ``("ok", id, value)`` or ``("err", id, error)``;
* ``("release", session_key)``: drop the session's engine caches.

And pushed to every front-end whenever it changes (checked every :data:`STATUS_PERIOD_S`):
``("status", Status)``: each model's health, admission counts, session counts and how many
front-ends are connected; once the models are loaded, ``("infos", {model: EngineInfo})``
(in the hello for a front-end that connects later). A front-end that disconnects has
its generations cancelled, its sessions' generation holds released and its quota leases
returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prismgate.compose import build_engine, build_quota, build_store
from prismgate.core.engine import Engine, EngineInfo
from prismgate.core.errors import Code, GatewayError
from prismgate.core.health import Health
from prismgate.core.pool import EnginePool
from prismgate.core.principal import Principal
from prismgate.core.quota import Quota
from prismgate.core.session import Session
from prismgate.core.stores import SessionStore
from prismgate.engines.tokenizer import HFTokenizer
from prismgate.settings import Settings
from prismgate.workers.wire import Channel, Message, pack_error

log = logging.getLogger("prismgate.workers.host")

STATUS_PERIOD_S = 0.05
EVICTION_PERIOD_S = 30.0

# A tokenizer crosses to the front-ends as the Hugging Face tokenizer it wraps (its lock is rebuilt there).
copyreg.pickle(HFTokenizer, lambda t: (HFTokenizer, (t.hf,)))


EngineFactory = Callable[[Settings], list[Engine]]


def served_engines(settings: Settings) -> list[Engine]:
    """One engine per served model and replica, as :func:`prismgate.compose.build_service` builds them."""
    return [build_engine(served) for served in settings.served() for _ in range(served.replicas)]


@dataclass
class Status:
    """What every front-end mirrors of the host: enough to answer /readyz, /metrics and the pool's questions."""

    health: dict[str, Health]
    in_flight: dict[str, int]
    active: int = 0
    queued: int = 0
    max_active: int = 0
    sessions: int = 0
    session_tokens: int = 0
    frontends: int = 0
    pid: int = 0


@dataclass
class _Peer:
    """One connected front-end and what it holds in the host."""

    channel: Channel
    streams: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    holds: dict[int, asyncio.Future[Session | None]] = field(default_factory=dict)  # generation holds by call id
    leases: set[tuple[Principal, str]] = field(default_factory=set)


class EngineHost:
    def __init__(self, settings: Settings, path: str, engines: EngineFactory | None = None) -> None:
        """``engines``: what builds the engines (default: the settings' models, as one process does;
        a benchmark passes its null engine)."""
        self.settings = settings
        self.path = path
        built = (engines or served_engines)(settings)
        self.pool = EnginePool(
            built,
            max_active=settings.max_active,
            max_queued=settings.max_queued,
            reserved_slots=settings.reserved_slots,
            memory_budget_bytes=settings.memory_budget_bytes,
        )
        self.store: SessionStore | None = None
        self.quota: Quota | None = None
        if settings.session_store == "memory":
            self.store = build_store(settings)
            self.quota = build_quota(settings)
            self.store.on_release(self.pool.release)
        self.peers: list[_Peer] = []
        self._infos: dict[str, EngineInfo] = {}
        self._last: Status | None = None
        self._started = False

    # -- the process ------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        server = await asyncio.start_unix_server(self._serve, path=self.path, limit=1 << 24)
        os.chmod(self.path, 0o600)
        tasks = [
            asyncio.create_task(self._load(), name="engine-load"),
            asyncio.create_task(self._push_status(), name="status"),
            asyncio.create_task(self._evict(), name="eviction"),
        ]
        await stop.wait()
        log.info("engine host stopping", extra={"frontends": len(self.peers)})
        self.pool.begin_stopping()
        server.close()
        for peer in list(self.peers):
            peer.channel.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.store is not None:
            await self.store.close_all()
        if self.quota is not None:
            await self.quota.close()
        await self.pool.close()
        log.info("engine host stopped")

    async def _load(self) -> None:
        try:
            await self.pool.start()
        except Exception:
            log.exception("the engine failed to start")
            return
        self._infos = {model: self.pool.engine(model).info for model in self.pool.models}
        self._started = True
        self._last = self.status()  # READY now: it goes first, so a front-end that has the infos is ready
        for peer in self.peers:  # once: an info (its tokenizer above all) is too big to go with every status
            peer.channel.send(("status", self._last))
            peer.channel.send(("infos", self._infos))

    async def _evict(self) -> None:
        while self.store is not None:
            await asyncio.sleep(EVICTION_PERIOD_S)
            evicted = await self.store.evict_expired()
            if evicted:
                log.info("evicted %d idle sessions", len(evicted))

    def status(self) -> Status:
        admission = self.pool.admission
        return Status(
            health={model: self.pool.health_of(model) for model in self.pool.models},
            in_flight={m: sum(e.in_flight() for e in self.pool.replicas(m).engines) for m in self.pool.models},
            active=admission.active,
            queued=admission.queued,
            max_active=admission.max_active,
            sessions=len(self.store) if self.store is not None else 0,
            session_tokens=self.store.total_tokens if self.store is not None else 0,
            frontends=len(self.peers),
            pid=os.getpid(),
        )

    async def _push_status(self) -> None:
        while True:
            status = self.status()
            if status != self._last:
                self._last = status
                for peer in self.peers:
                    peer.channel.send(("status", status))
            await asyncio.sleep(STATUS_PERIOD_S)

    # -- one front-end ----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _Peer(Channel(reader, writer))
        self.peers.append(peer)
        peer.channel.send(("hello", self.pool.models, self.store is not None, self.status(), self._infos))
        try:
            while True:
                for message in await peer.channel.receive():
                    self._dispatch(peer, message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.peers.remove(peer)
            await self._forget(peer)

    async def _forget(self, peer: _Peer) -> None:
        """A front-end went away: cancel its generations, end its session holds, return its leases."""
        for task in list(peer.streams.values()):
            task.cancel()
        for hold in peer.holds.values():
            if not hold.done():
                hold.set_result(None)
        if self.quota is not None:
            for principal, request_id in peer.leases:
                await self.quota.release(principal, request_id)
        peer.channel.closed = True

    def _dispatch(self, peer: _Peer, message: Message) -> None:
        kind = message[0]
        if kind == "gen":
            _, call, model, request, share = message
            peer.streams[call] = asyncio.create_task(self._stream(peer, call, model, request, share))
        elif kind == "cancel":
            task = peer.streams.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == "release":
            self.pool.release(message[1])
        elif kind == "call":
            _, call, target, method, args = message
            _keep(asyncio.create_task(self._call(peer, call, target, method, args)))
        elif kind == "exit":  # the end of a generation hold: (exit, hold id, session as the front-end left it)
            hold = peer.holds.pop(message[1], None)
            if hold is not None and not hold.done():
                hold.set_result(message[2])

    async def _stream(self, peer: _Peer, call: int, model: str, request: Any, share: Any) -> None:
        send = peer.channel.send
        try:
            stream = self.pool.generate(model, request, share)
            try:
                async for event in stream:
                    send(("ev", call, event))
                    if peer.channel.writer.transport.get_write_buffer_size() > 1 << 20:
                        await peer.channel.drain()
            finally:
                await stream.aclose()
            send(("end", call))
        except asyncio.CancelledError:
            send(("end", call))
        except Exception as exc:
            send(("err", call, pack_error(exc)))
        finally:
            peer.streams.pop(call, None)

    async def _call(self, peer: _Peer, call: int, target: str, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = await self._run(peer, call, target, method, args)
        except Exception as exc:
            peer.channel.send(("err", call, pack_error(exc)))
        else:
            peer.channel.send(("ok", call, value))

    async def _run(self, peer: _Peer, call: int, target: str, method: str, args: tuple[Any, ...]) -> Any:
        if target == "engine":
            model, data, mime = args
            return await asyncio.to_thread(self.pool.engine(model).image_tokens, data, mime)
        if target == "quota":
            if self.quota is None:
                raise GatewayError(Code.INTERNAL, "the engine host holds no quota (a Redis store is configured)")
            principal, rest = args[0], args[1]
            if method == "admit":
                await self.quota.admit(principal, rest)
                peer.leases.add((principal, rest))
            elif method == "release":
                peer.leases.discard((principal, rest))
                await self.quota.release(principal, rest)
            elif method == "charge":
                await self.quota.charge(principal, rest)
            return None
        if self.store is None:
            raise GatewayError(Code.INTERNAL, "the engine host holds no sessions (a Redis store is configured)")
        if method == "hold":
            return await self._hold(peer, call, args[0])
        if method not in _STORE_CALLS:
            raise GatewayError(Code.INTERNAL, f"no store call {method!r}")
        positional, named = (args[0], args[1]) if method in _NAMED else (args, {})
        return await getattr(self.store, method)(*positional, **named)

    async def _hold(self, peer: _Peer, call: int, session_id: str) -> Session:
        """Enter the store's generation for ``session_id`` and keep it until the front-end's ``exit``."""
        assert self.store is not None
        entered: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
        done: asyncio.Future[Session | None] = asyncio.get_running_loop().create_future()
        peer.holds[call] = done

        async def hold() -> None:
            assert self.store is not None
            try:
                async with self.store.generation(session_id) as session:
                    entered.set_result(session)
                    left = await done
                    if left is not None:  # what the front-end's generation left in the timeline
                        session.tokens, session.images = left.tokens, left.images
                        session.steering, session.standing_steering = left.steering, left.standing_steering
            except BaseException as exc:
                if not entered.done():
                    entered.set_exception(exc)
                    peer.holds.pop(call, None)

        _keep(asyncio.create_task(hold()))
        return await entered


_TASKS: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    """Hold a reference to a task nobody awaits until it is done (the loop keeps only weak ones)."""
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


_NAMED = frozenset({"create", "fork"})  # their arguments come as (positional, keywords)
_STORE_CALLS = frozenset({"create", "get", "fork", "owners", "close", "reserve", "evict_expired", "unreachable"})


def host_main(settings: Settings, path: str, engines: EngineFactory | None = None) -> None:
    """The engine host process's entry point (``multiprocessing`` spawn)."""
    from prismgate import logs

    logs.configure(settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the host stops
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(EngineHost(settings, path, engines).run())
