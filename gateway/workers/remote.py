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
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec

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
from prismgate.engines.tokenizer import load_tokenizer
from prismgate.workers import wire
from prismgate.workers.wire import (
    BlockingChannel,
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
    WireError,
    unpack_error,
)

log = logging.getLogger("prismgate.workers.remote")

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
        self._calls: dict[int, asyncio.Future[msgspec.Raw]] = {}
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.loading_infos = False
        self.gone = False

    async def connect(self) -> None:
        reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 24)
        self._channel = Channel(reader, writer)
        self._channel.send(Join())
        messages = await self._channel.receive()
        hello = messages[0] if messages else None
        if not isinstance(hello, Hello):
            raise LinkError(f"the engine host answered {type(hello).__name__}, not its hello")
        self.models, self.holds_sessions, self.status = hello.models, hello.holds_sessions, hello.status
        self.infos = await _engine_infos(hello.infos)
        self._ready_when_loaded()
        for message in messages[1:]:
            self._dispatch(message)
        self._reader = asyncio.create_task(self._read(), name="engine-host-link")

    async def _read(self) -> None:
        assert self._channel is not None
        try:
            while True:
                for message in await self._channel.receive():
                    self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
            pass
        except LinkError as exc:
            log.error("the engine host sent a frame off the link's rules: %s", exc)
        finally:
            self.gone = True
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(GatewayError(Code.UNAVAILABLE, HOST_GONE))
            for queue in self._streams.values():
                queue.put_nowait(WireError(int(Code.UNAVAILABLE), HOST_GONE))

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, (Token, Finished)):
            queue = self._streams.get(message.call)
            if queue is not None:  # a stream this end cancelled has gone from here already
                queue.put_nowait(message.event)
        elif isinstance(message, End):
            if message.call in self._streams:
                self._streams[message.call].put_nowait(_END)
        elif isinstance(message, Error) and message.call in self._streams:
            self._streams[message.call].put_nowait(message.error)
        elif isinstance(message, (Ok, Error)):
            future = self._calls.pop(message.call, None)
            if future is not None and not future.done():
                if isinstance(message, Ok):
                    future.set_result(message.value)
                else:
                    future.set_exception(unpack_error(message.error))
        elif isinstance(message, StatusUpdate):
            self.status = message.status
        elif isinstance(message, Infos):
            self._load_infos(message.infos)
        else:
            raise LinkError(f"the engine host may not send {type(message).__name__}")

    def _load_infos(self, infos: dict[str, ModelInfo]) -> None:
        """Load the tokenizers off the loop; until then the models read as loading."""

        async def load() -> None:
            try:
                self.infos = await _engine_infos(infos)
                self._ready_when_loaded()
            finally:
                self.loading_infos = False

        self.loading_infos = True
        task = asyncio.create_task(load(), name="engine-infos")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ready_when_loaded(self) -> None:
        """Tell the host this front-end can serve once it holds every model's tokenizer: the
        host counts only such front-ends, so /readyz on any of them waits for all."""
        if self.models and set(self.models) <= set(self.infos):
            self.send(Ready())

    def send(self, message: Message) -> None:
        if self._channel is not None:
            self._channel.send(message)

    def _check(self) -> None:
        if self.gone:
            raise GatewayError(Code.UNAVAILABLE, HOST_GONE)
        if self._channel is None:
            raise GatewayError(Code.UNAVAILABLE, "not connected to the engine host yet")

    async def call(self, target: Target, method: str, args: tuple[Any, ...], answer: Any = None) -> Any:
        """One call on the host's ``target``; its answer decoded as ``answer`` (a type)."""
        return wire.decode((await self._call(target, method, args))[1], answer)

    async def hold(self, session_id: str) -> tuple[int, Session]:
        """Enter a generation on the host's session: (the hold's id, for its ``exit``; the session)."""
        call, raw = await self._call(Target.STORE, "hold", (session_id,))
        session: Session = wire.decode(raw, Session)
        return call, session

    async def _call(self, target: Target, method: str, args: tuple[Any, ...]) -> tuple[int, msgspec.Raw]:
        self._check()
        call = next(self._ids)
        future: asyncio.Future[msgspec.Raw] = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        self.send(Call(call, target, method, msgspec.Raw(wire.encode(args))))
        return call, await future

    async def stream(self, model: str, request: EngineRequest, share: Share) -> AsyncGenerator[Event, None]:
        self._check()
        call = next(self._ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[call] = queue
        self.send(Generate(call, model, request, share))
        ended = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    ended = True
                    return
                if isinstance(item, WireError):
                    ended = True
                    raise unpack_error(item)
                yield item
        finally:
            self._streams.pop(call, None)
            if not ended:
                self.send(Cancel(call))

    def call_blocking(self, method: str, args: tuple[Any, ...], answer: Any) -> Any:
        """An engine call from a worker thread (image sizing): over a connection of its own, so it never
        waits on the loop; the connection does not join, so the host answers it and keeps no peer for it."""
        channel = BlockingChannel(self.path)
        try:
            channel.send(Call(0, Target.ENGINE, method, msgspec.Raw(wire.encode(args))))
            while True:
                for message in channel.receive():
                    if isinstance(message, Ok) and message.call == 0:
                        return wire.decode(message.value, answer)
                    if isinstance(message, Error) and message.call == 0:
                        raise unpack_error(message.error)
        except (LinkError, OSError) as exc:
            raise GatewayError(Code.UNAVAILABLE, f"{HOST_GONE} ({exc})") from None
        finally:
            channel.close()

    async def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        for task in list(self._tasks):
            task.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def _engine_infos(infos: dict[str, ModelInfo]) -> dict[str, EngineInfo]:
    """Each model's info with the tokenizer this process loads from the model's folder (off the loop)."""
    loaded: dict[str, EngineInfo] = {}
    for model, info in infos.items():
        tokenizer = await asyncio.to_thread(load_tokenizer, info.tokenizer_path)
        fields = {name: getattr(info, name) for name in info.__struct_fields__ if name != "tokenizer_path"}
        loaded[model] = EngineInfo(tokenizer=tokenizer, **fields)
    return loaded


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
        if status is None or self.link.loading_infos:  # the tokenizers are still loading in this process
            return health.LOADING
        return status.health.get(self.model_id, health.LOADING)

    async def close(self) -> None:
        """Nothing to free here: the host closes the engine once every front-end has stopped."""

    def generate(self, request: EngineRequest, share: Share = ANY) -> AsyncGenerator[Event, None]:
        return self.link.stream(self.model_id, request, share)

    def image_tokens(self, data: bytes, mime: str) -> int:
        return int(self.link.call_blocking("image_tokens", (self.model_id, data, mime), int))

    def release(self, session_key: str) -> None:
        self.link.send(Release(session_key))

    def in_flight(self) -> int:
        status = self.link.status
        return status.in_flight.get(self.model_id, 0) if status is not None else 0


class _Mirrored:
    """An admission count read from the host's last status (0 before the first); writes, which the
    base class makes as it counts, are ignored: the host counts."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, admission: Any, owner: Any = None) -> int:
        status: Status | None = admission._link.status
        return int(getattr(status, self.field)) if status is not None else 0

    def __set__(self, admission: Any, value: int) -> None:
        pass


class _HostAdmission(Admission):
    """The host's admission counts, for /metrics (admission itself happens in the host)."""

    active = _Mirrored("active")
    queued = _Mirrored("queued")
    max_active = _Mirrored("max_active")
    preemptions = _Mirrored("preemptions")
    recomputes = _Mirrored("recomputes")

    def __init__(self, link: HostLink) -> None:
        self._link = link
        super().__init__(max_active=1, max_queued=0)


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
        self.link.send(Release(session_key))

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

    async def _store(self, method: str, args: tuple[Any, ...], answer: Any) -> Any:
        return await self.link.call(Target.STORE, method, args, answer)

    async def create(self, model: str, *, pinned: bool = False, owner: str = "") -> Session:
        session: Session = await self._store("create", (model, pinned, owner), Session)
        return session

    async def get(self, session_id: str) -> Session:
        session: Session = await self._store("get", (session_id,), Session)
        return session

    async def fork(self, session_id: str, at_position: int, *, owner: str | None = None) -> Session:
        session: Session = await self._store("fork", (session_id, at_position, owner), Session)
        return session

    async def owners(self) -> dict[str, str]:
        owners: dict[str, str] = await self._store("owners", (), dict[str, str])
        return owners

    async def close(self, session_id: str) -> bool:
        return bool(await self._store("close", (session_id,), bool))

    @contextlib.asynccontextmanager
    async def generation(self, session_id: str) -> AsyncIterator[Session]:
        call, session = await self.link.hold(session_id)
        try:
            yield session
        finally:
            self.link.send(Exit(call, session))

    async def unreachable(self) -> str | None:
        return HOST_GONE if self.link.gone else None

    async def reserve(self, extra_tokens: int) -> None:
        await self._store("reserve", (extra_tokens,), None)

    async def evict_expired(self) -> list[str]:
        return []  # the host evicts on its own clock

    async def close_all(self) -> int:
        return 0  # the sessions stay in the host for the other front-ends; it closes them when it stops


class RemoteQuota(Quota):
    """The host's per-key counts: a key's limits hold across every front-end process."""

    def __init__(self, link: HostLink) -> None:
        self.link = link

    async def admit(self, principal: Principal, request_id: str) -> None:
        await self.link.call(Target.QUOTA, "admit", (principal, request_id))

    async def release(self, principal: Principal, request_id: str) -> None:
        await self.link.call(Target.QUOTA, "release", (principal, request_id))

    async def charge(self, principal: Principal, tokens: int) -> None:
        await self.link.call(Target.QUOTA, "charge", (principal, tokens))
