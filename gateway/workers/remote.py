"""A front-end process's view of the engine host: a pool, an engine per model, a store and a quota.

Each forwards to the host (:mod:`prismgate.workers.host`) over one :class:`HostLink`, so
the codecs and the core service run in the front-end unchanged: the service is built
from a :class:`RemotePool`, and, with the in-memory session store, a :class:`RemoteStore`
and a :class:`RemoteQuota`.

What is answered locally, from the host's last pushed :class:`~prismgate.workers.host.Status`
(at most :data:`~prismgate.workers.host.STATUS_PERIOD_S` old): health (``/readyz``), the
engines' info (the tokenizer runs in the front-end, so tokenizing and detokenizing spread
over the processes), admission and session counts for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import socket
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from prismgate.core import health
from prismgate.core.engine import EngineInfo, EngineRequest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Event
from prismgate.core.fairness import ANY, Share
from prismgate.core.health import Health
from prismgate.core.pool import Admission, EnginePool
from prismgate.core.principal import Principal
from prismgate.core.quota import Quota
from prismgate.core.session import Session
from prismgate.core.stores import SessionStore
from prismgate.workers.host import Status
from prismgate.workers.wire import HEADER, Channel, Message, unpack_error

HOST_GONE = "the engine host process has gone"
_END = object()


class HostLink:
    """The front-end's one connection to the host: calls, streams and the mirrored status."""

    def __init__(self, path: str, workers: int) -> None:
        self.path = path
        self.workers = workers
        self.models: list[str] = []
        self.holds_sessions = False
        self.status: Status | None = None
        self.infos: dict[str, EngineInfo] = {}  # each model's, once the host has loaded it
        self._channel: Channel | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.gone = False

    async def connect(self) -> None:
        reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 24)
        self._channel = Channel(reader, writer)
        hello = (await self._channel.receive())[0]
        _, self.models, self.holds_sessions, self.status, self.infos = hello
        self._reader = asyncio.create_task(self._read(), name="engine-host-link")

    async def _read(self) -> None:
        assert self._channel is not None
        try:
            while True:
                for message in await self._channel.receive():
                    self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.gone = True
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(GatewayError(Code.UNAVAILABLE, HOST_GONE))
            for queue in self._streams.values():
                queue.put_nowait(("err", None, (int(Code.UNAVAILABLE), HOST_GONE, None)))

    def _dispatch(self, message: Message) -> None:
        kind = message[0]
        if kind == "ev":
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait(message[2])
        elif kind in ("end", "err") and message[1] in self._streams:
            self._streams[message[1]].put_nowait(message if kind == "err" else _END)
        elif kind == "ok" or kind == "err":
            future = self._calls.pop(message[1], None)
            if future is not None and not future.done():
                if kind == "ok":
                    future.set_result(message[2])
                else:
                    future.set_exception(unpack_error(message[2]))
        elif kind == "status":
            self.status = message[1]
        elif kind == "infos":
            self.infos = message[1]

    def send(self, message: Message) -> None:
        if self._channel is not None:
            self._channel.send(message)

    def _check(self) -> None:
        if self.gone:
            raise GatewayError(Code.UNAVAILABLE, HOST_GONE)
        if self._channel is None:
            raise GatewayError(Code.UNAVAILABLE, "not connected to the engine host yet")

    async def call(self, target: str, method: str, *args: Any) -> Any:
        return (await self._call(target, method, args))[1]

    async def hold(self, session_id: str) -> tuple[int, Session]:
        """Enter a generation on the host's session: (the hold's id, for its ``exit``; the session)."""
        call, session = await self._call("store", "hold", (session_id,))
        return call, session

    async def _call(self, target: str, method: str, args: tuple[Any, ...]) -> tuple[int, Any]:
        self._check()
        call = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        self.send(("call", call, target, method, args))
        return call, await future

    async def stream(self, model: str, request: EngineRequest, share: Share) -> AsyncGenerator[Event, None]:
        self._check()
        call = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call] = queue
        self.send(("gen", call, model, request, share))
        ended = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    ended = True
                    return
                if isinstance(item, tuple):
                    ended = True
                    raise unpack_error(item[2])
                yield item
        finally:
            self._streams.pop(call, None)
            if not ended:
                self.send(("cancel", call))

    def call_blocking(self, target: str, method: str, *args: Any) -> Any:
        """A call from a worker thread (image sizing): over a connection of its own, so it never waits on the loop."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(self.path)
            file = sock.makefile("rb")
            hello_size = HEADER.unpack(file.read(HEADER.size))[0]
            file.read(hello_size)
            body = pickle.dumps([("call", 0, target, method, args)], protocol=pickle.HIGHEST_PROTOCOL)
            sock.sendall(HEADER.pack(len(body)) + body)
            while True:
                size = HEADER.unpack(file.read(HEADER.size))[0]
                for message in pickle.loads(file.read(size)):
                    if message[0] == "ok" and message[1] == 0:
                        return message[2]
                    if message[0] == "err" and message[1] == 0:
                        raise unpack_error(message[2])

    async def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class RemoteEngine:
    """One served model as the host runs it (its replicas, admission and caches are the host's)."""

    def __init__(self, link: HostLink, model_id: str) -> None:
        self.link = link
        self.model_id = model_id

    @property
    def info(self) -> EngineInfo:
        info = self.link.infos.get(self.model_id)
        if info is None:
            raise GatewayError(Code.UNAVAILABLE, f"model {self.model_id!r} is still loading")
        return info

    async def start(self) -> None:
        """Wait until the host has loaded the model (or failed to)."""
        while True:
            if self.link.gone:
                raise RuntimeError(HOST_GONE)
            if self.model_id in self.link.infos:
                return
            status = self.link.status
            state = status.health.get(self.model_id) if status is not None else None
            if state is not None and state.state is health.HealthState.FAILED:
                raise RuntimeError(f"the engine host could not load {self.model_id}: {state.reason}")
            await asyncio.sleep(0.05)

    def health(self) -> Health:
        if self.link.gone:
            return health.failed(HOST_GONE)
        status = self.link.status
        if status is None:
            return health.LOADING
        return status.health.get(self.model_id, health.LOADING)

    async def close(self) -> None:
        """Nothing to free here: the host closes the engine once every front-end has stopped."""

    def generate(self, request: EngineRequest, share: Share = ANY) -> AsyncGenerator[Event, None]:
        return self.link.stream(self.model_id, request, share)

    def image_tokens(self, data: bytes, mime: str) -> int:
        return int(self.link.call_blocking("engine", "image_tokens", self.model_id, data, mime))

    def release(self, session_key: str) -> None:
        self.link.send(("release", session_key))

    def in_flight(self) -> int:
        status = self.link.status
        return status.in_flight.get(self.model_id, 0) if status is not None else 0


class _HostAdmission(Admission):
    """The host's admission counts, for /metrics (admission itself happens in the host)."""

    def __init__(self, link: HostLink) -> None:
        super().__init__(max_active=1, max_queued=0)
        self._link = link

    def _now(self) -> Status | None:
        return self._link.status

    @property
    def active(self) -> int:
        status = self._now()
        return status.active if status is not None else 0

    @active.setter
    def active(self, value: int) -> None:
        pass

    @property
    def queued(self) -> int:
        status = self._now()
        return status.queued if status is not None else 0

    @property
    def max_active(self) -> int:
        status = self._now()
        return status.max_active if status is not None else 0

    @max_active.setter
    def max_active(self, value: int) -> None:
        pass


class RemotePool(EnginePool):
    """The pool a front-end's service sees: every generation goes to the host's pool, with its share.

    Ready only once the host's models are and all ``workers`` front-ends are connected, so a
    load balancer sees the server ready when every process is.
    """

    def __init__(self, link: HostLink) -> None:
        super().__init__([RemoteEngine(link, model) for model in link.models])
        self.link = link
        self.admission = _HostAdmission(link)

    def health(self) -> Health:
        own = super().health()
        if not own.ready:
            return own
        status = self.link.status
        connected = status.frontends if status is not None else 0
        if connected < self.link.workers:
            return Health(
                health.HealthState.LOADING, f"front-end processes starting ({connected} of {self.link.workers})"
            )
        return own

    async def start(self) -> None:
        """Until the host's models are loaded and every front-end is connected: this front-end's
        gRPC health, ``prismgate_ready`` and "ready" log line then agree with ``/readyz``."""
        await super().start()
        while (status := self.link.status) is None or status.frontends < self.link.workers:
            if self.link.gone:
                raise RuntimeError(HOST_GONE)
            await asyncio.sleep(0.05)

    def release(self, session_key: str) -> None:
        self.link.send(("release", session_key))

    async def generate(
        self, model: str | None, request: EngineRequest, share: Share = ANY
    ) -> AsyncGenerator[Event, None]:
        stream = self.link.stream(self.replicas(model).engines[0].model_id, request, share)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()


class RemoteStore(SessionStore):
    """The host's in-memory sessions. A generation holds the session in the host (busy there for every
    front-end) and saves what it leaves when it ends, as the Redis store does."""

    def __init__(self, link: HostLink) -> None:
        super().__init__()
        self.link = link

    def __len__(self) -> int:
        status = self.link.status
        return status.sessions if status is not None else 0

    @property
    def total_tokens(self) -> int:
        status = self.link.status
        return status.session_tokens if status is not None else 0

    async def _store(self, method: str, *args: Any) -> Any:
        return await self.link.call("store", method, *args)

    async def create(self, model: str, *, pinned: bool = False, owner: str = "") -> Session:
        session: Session = await self._store("create", (model,), {"pinned": pinned, "owner": owner})
        return session

    async def get(self, session_id: str) -> Session:
        session: Session = await self._store("get", session_id)
        return session

    async def fork(self, session_id: str, at_position: int, *, owner: str | None = None) -> Session:
        session: Session = await self._store("fork", (session_id, at_position), {"owner": owner})
        return session

    async def owners(self) -> dict[str, str]:
        owners: dict[str, str] = await self._store("owners")
        return owners

    async def close(self, session_id: str) -> bool:
        return bool(await self._store("close", session_id))

    @contextlib.asynccontextmanager
    async def generation(self, session_id: str) -> AsyncIterator[Session]:
        call, session = await self.link.hold(session_id)
        try:
            yield session
        finally:
            self.link.send(("exit", call, session))

    async def unreachable(self) -> str | None:
        return HOST_GONE if self.link.gone else None

    async def reserve(self, extra_tokens: int) -> None:
        await self._store("reserve", extra_tokens)

    async def evict_expired(self) -> list[str]:
        return []  # the host evicts on its own clock

    async def close_all(self) -> int:
        return 0  # the sessions stay in the host for the other front-ends; it closes them when it stops


class RemoteQuota(Quota):
    """The host's per-key counts: a key's limits hold across every front-end process."""

    def __init__(self, link: HostLink) -> None:
        self.link = link

    async def admit(self, principal: Principal, request_id: str) -> None:
        await self.link.call("quota", "admit", principal, request_id)

    async def release(self, principal: Principal, request_id: str) -> None:
        await self.link.call("quota", "release", principal, request_id)

    async def charge(self, principal: Principal, tokens: int) -> None:
        await self.link.call("quota", "charge", principal, tokens)
