"""The engine host: the one process that runs the engines for every front-end process.

It builds the served models' engines as a single-process server does, and the one
:class:`~prismgate.core.pool.EnginePool` over them, so admission, each key's fair share, the
memory budget and session affinity are decided once for all front-ends; with
``session_store = "memory"`` it also holds the sessions and the per-key quota counts. It serves
them over a Unix socket in the typed messages of :mod:`prismgate.workers.wire`: a front-end that
joins is a peer, whose work is undone when it disconnects; a connection that calls first is a
side call. The design and the messages: docs/architecture.md, "Several front-end processes".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from prismgate.compose import build_engine, build_pool, build_quota, build_store
from prismgate.core.engine import Engine, EngineInfo
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import TokenEvent
from prismgate.core.principal import Principal
from prismgate.core.quota import Quota
from prismgate.core.session import Session
from prismgate.core.stores import SessionStore
from prismgate.settings import Settings
from prismgate.workers import wire
from prismgate.workers.wire import (
    Call,
    Cancel,
    Channel,
    End,
    Error,
    Exit,
    Finished,
    Generate,
    Hello,
    Infos,
    Join,
    LinkError,
    Message,
    ModelInfo,
    Ok,
    Ready,
    Release,
    Status,
    StatusUpdate,
    Target,
    Token,
    pack_error,
)

log = logging.getLogger("prismgate.workers.host")

STATUS_PERIOD_S = 0.05
EVICTION_PERIOD_S = 30.0

EngineFactory = Callable[[Settings], list[Engine]]


def served_engines(settings: Settings) -> list[Engine]:
    """One engine per served model and replica, as :func:`prismgate.compose.build_service` builds them."""
    return [build_engine(served) for served in settings.served() for _ in range(served.transformers.replicas)]


@dataclass
class _Peer:
    """One connected front-end and what it holds in the host."""

    channel: Channel
    streams: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    holds: dict[int, asyncio.Future[Session | None]] = field(default_factory=dict)  # generation holds by call id
    leases: set[tuple[Principal, str]] = field(default_factory=set)
    ready: bool = False  # its tokenizers are loaded (it sent ready): it can serve


class EngineHost:
    def __init__(self, settings: Settings, path: str, engines: EngineFactory | None = None) -> None:
        """``engines``: what builds the engines (default: the settings' models, as one process does;
        a benchmark passes its null engine)."""
        self.settings = settings
        self.path = path
        built = (engines or served_engines)(settings)
        self.pool = build_pool(settings, built)
        self.store: SessionStore | None = None
        self.quota: Quota | None = None
        if settings.sessions.store == "memory":
            self.store = build_store(settings)
            self.quota = build_quota(settings)
            self.store.on_release(self.pool.release)
        self.peers: list[_Peer] = []
        self._infos: dict[str, ModelInfo] = {}
        self._last: Status | None = None
        self._saved: list[Path] = []
        self._started = False

    # -- the process ------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        # bound, listening and private under another name, then moved into place: whoever finds the
        # path (the supervisor and the front-ends wait for it) can connect, and no one else could
        pending = f"{self.path}.new"
        server = await asyncio.start_unix_server(self._serve, path=pending, limit=1 << 24)
        os.chmod(pending, 0o600)
        os.replace(pending, self.path)
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
        self._infos = {model: self._model_info(self.pool.engine(model).info) for model in self.pool.models}
        self._started = True
        self._last = self.status()  # READY now: it goes first, so a front-end that has the infos is ready
        for peer in self.peers:  # once: an info (its tokenizer above all) is too big to go with every status
            peer.channel.send(StatusUpdate(self._last))
            peer.channel.send(Infos(self._infos))

    def _model_info(self, info: EngineInfo) -> ModelInfo:
        """What crosses of ``info``; a tokenizer built in memory is saved beside the socket for the front-ends."""
        crossing = wire.model_info(info)
        if not crossing.tokenizer_path or not Path(crossing.tokenizer_path).is_dir():
            folder = Path(self.path).parent / "tokenizers" / str(len(self._saved))
            getattr(info.tokenizer, "hf").save_pretrained(folder)  # noqa: B009 (the HF tokenizer behind the contract)
            self._saved.append(folder)
            crossing = msgspec.structs.replace(crossing, tokenizer_path=str(folder))
        return crossing

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
            preemptions=admission.preemptions,
            recomputes=admission.recomputes,
            sessions=len(self.store) if self.store is not None else 0,
            session_tokens=self.store.total_tokens if self.store is not None else 0,
            frontends=sum(peer.ready for peer in self.peers),
            pid=os.getpid(),
        )

    async def _push_status(self) -> None:
        while True:
            status = self.status()
            if status != self._last:
                self._last = status
                for peer in self.peers:
                    peer.channel.send(StatusUpdate(status))
            await asyncio.sleep(STATUS_PERIOD_S)

    # -- one front-end ----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer)
        peer: _Peer | None = None
        try:
            first = await channel.receive()
            if first and isinstance(first[0], Join):
                peer = _Peer(channel)
                self.peers.append(peer)
                channel.send(Hello(self.pool.models, self.store is not None, self.status(), self._infos))
                first = first[1:]
            else:
                await self._side_calls(channel, first)
                return
            for message in first:
                self._dispatch(peer, message)
            while True:
                for message in await channel.receive():
                    self._dispatch(peer, message)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            pass
        except LinkError as exc:
            log.warning("dropped a connection on the engine host's socket: %s", exc)
        finally:
            if peer is not None:
                self.peers.remove(peer)
                await self._forget(peer)
            channel.close()

    async def _side_calls(self, channel: Channel, messages: list[Message]) -> None:
        """A connection that did not join: engine calls only, answered on it; it is no peer."""
        while True:
            for message in messages:
                if not isinstance(message, Call) or message.target is not Target.ENGINE:
                    raise LinkError(f"a side call may only call an engine, not send {type(message).__name__}")
                try:
                    value = await self._engine_call(message)
                except LinkError:
                    raise
                except Exception as exc:
                    channel.send(Error(message.call, pack_error(exc)))
                else:
                    channel.send(Ok(message.call, msgspec.Raw(wire.encode(value))))
            messages = await channel.receive()

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
        if isinstance(message, Generate):
            call = message.call
            peer.streams[call] = asyncio.create_task(
                self._stream(peer, call, message.model, message.request, message.share)
            )
        elif isinstance(message, Cancel):
            task = peer.streams.get(message.call)
            if task is not None:
                task.cancel()
        elif isinstance(message, Release):
            self.pool.release(message.session_key)
        elif isinstance(message, Ready):
            peer.ready = True
        elif isinstance(message, Call):
            _keep(asyncio.create_task(self._call(peer, message)))
        elif isinstance(message, Exit):
            hold = peer.holds.pop(message.call, None)
            if hold is not None and not hold.done():
                hold.set_result(message.session)
        else:
            raise LinkError(f"a front-end may not send {type(message).__name__}")

    async def _stream(self, peer: _Peer, call: int, model: str, request: Any, share: Any) -> None:
        send = peer.channel.send
        try:
            stream = self.pool.generate(model, request, share)
            try:
                async for event in stream:
                    send(Token(call, event) if isinstance(event, TokenEvent) else Finished(call, event))
                    if peer.channel.writer.transport.get_write_buffer_size() > 1 << 20:
                        await peer.channel.drain()
            finally:
                await stream.aclose()
            send(End(call))
        except asyncio.CancelledError:
            send(End(call))
        except Exception as exc:
            send(Error(call, pack_error(exc)))
        finally:
            peer.streams.pop(call, None)

    async def _call(self, peer: _Peer, message: Call) -> None:
        try:
            value = await self._run(peer, message)
        except LinkError as exc:  # arguments off their schema: the same as a malformed frame
            log.warning("dropped a front-end's connection to the engine host: %s", exc)
            peer.channel.close()
        except Exception as exc:
            peer.channel.send(Error(message.call, pack_error(exc)))
        else:
            peer.channel.send(Ok(message.call, msgspec.Raw(wire.encode(value))))

    async def _engine_call(self, message: Call) -> int:
        if message.method != "image_tokens":
            raise LinkError(f"no engine call {message.method!r}")
        model, data, mime = wire.decode(message.args, tuple[str, bytes, str])
        return int(await asyncio.to_thread(self.pool.engine(model).image_tokens, data, mime))

    async def _run(self, peer: _Peer, message: Call) -> Any:
        target, method, call = message.target, message.method, message.call
        if target is Target.ENGINE:
            return await self._engine_call(message)
        if target is Target.QUOTA:
            if method not in _QUOTA_ARGS:
                raise LinkError(f"no quota call {method!r}")
            principal, rest = wire.decode(message.args, _QUOTA_ARGS[method])
            if self.quota is None:
                raise GatewayError(Code.INTERNAL, "the engine host holds no quota (a Redis store is configured)")
            if method == "admit":
                await self.quota.admit(principal, rest)
                peer.leases.add((principal, rest))
            elif method == "release":
                peer.leases.discard((principal, rest))
                await self.quota.release(principal, rest)
            else:
                await self.quota.charge(principal, rest)
            return None
        if method not in _STORE_ARGS:
            raise LinkError(f"no store call {method!r}")
        args = wire.decode(message.args, _STORE_ARGS[method])
        if self.store is None:
            raise GatewayError(Code.INTERNAL, "the engine host holds no sessions (a Redis store is configured)")
        if method == "hold":
            return await self._hold(peer, call, args[0])
        if method == "create":
            model, pinned, owner = args
            return await self.store.create(model, pinned=pinned, owner=owner)
        if method == "fork":
            session_id, at_position, fork_owner = args
            return await self.store.fork(session_id, at_position, owner=fork_owner)
        return await getattr(self.store, method)(*args)

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


# each call's arguments, decoded against these schemas (docs/architecture.md: the process link)
_STORE_ARGS: dict[str, Any] = {
    "create": tuple[str, bool, str],  # model, pinned, owner
    "get": tuple[str],
    "fork": tuple[str, int, str | None],  # session id, position, owner
    "owners": tuple[()],
    "close": tuple[str],
    "reserve": tuple[int],
    "unreachable": tuple[()],
    "hold": tuple[str],
}
_QUOTA_ARGS: dict[str, Any] = {
    "admit": tuple[Principal, str],
    "release": tuple[Principal, str],
    "charge": tuple[Principal, int],
}


def host_main(settings: Settings, path: str, engines: EngineFactory | None = None) -> None:
    """The engine host process's entry point (``multiprocessing`` spawn)."""
    from prismgate import logs

    logs.configure(settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the host stops
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(EngineHost(settings, path, engines).run())
