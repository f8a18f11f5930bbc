"""One Evergreen session, independent of its transport (WebSocket or gRPC stream).

The transport feeds decoded ``SessionMessage``s to :meth:`EvergreenSession.feed`, drains
:attr:`EvergreenSession.outbox`, and ends the session when :attr:`failed` resolves
(:mod:`prismgate.codecs.evergreen.errors`). Each connection holds one core session, whose token
timeline is the running conversation. This module dispatches and tracks the actions (reading
one is :mod:`.actions`, running a GENERATE :mod:`.generate`): a ``GENERATE`` waits for its input
tree, and GENERATEs run one at a time in the order their inputs become ready; ``DROP``
(extension) forgets nodes once every earlier action has read its inputs; ``CANCEL`` (extension)
stops the action writing the named output, closing its outputs with what they have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prismgate.codecs.evergreen.actions import GenerateCall, read_generate, read_ids
from prismgate.codecs.evergreen.barrier import ReadBarrier
from prismgate.codecs.evergreen.generate import Generation
from prismgate.codecs.evergreen.nodes import Limits, NodeStore
from prismgate.codecs.evergreen.outbox import Outbox
from prismgate.codecs.evergreen.payloads import RefPolicy
from prismgate.codecs.evergreen.prompt import messages_from_tree
from prismgate.core.errors import Code, GatewayError, exhausted, invalid, not_found
from prismgate.core.events import FinishReason
from prismgate.core.service import SessionService
from prismgate.schemas import evergreen_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Options:
    limits: Limits = field(default_factory=Limits)
    refs: RefPolicy = field(default_factory=RefPolicy)
    default_max_tokens: int = 256
    model: str | None = None
    slow_client_timeout_s: float | None = None  # the transport's write deadline (None: none)
    buffer_bytes: int = 1024 * 1024  # output held for a slow reader before generation waits for it


@dataclass(eq=False)
class Run:
    """One action in flight."""

    index: int
    outputs: dict[str, str]  # output name -> node id
    label: str
    task: asyncio.Task[None] | None = None
    cancel_requested: bool = False
    finished: bool = False


class EvergreenSession:
    def __init__(self, service: SessionService, options: Options | None = None) -> None:
        self.service = service
        self.options = options or Options()
        self.store = NodeStore(self.options.limits)
        # What to send, in order; ``None`` marks the end (after a failure, or when the input
        # ended and every action finished): the transport stops there.
        self.outbox = Outbox(self.options.buffer_bytes)
        self.failed: asyncio.Future[GatewayError] = asyncio.get_running_loop().create_future()
        self.model = service.models.resolve(self.options.model)
        # the core session is opened by the first GENERATE: an idle connection holds none
        self.core_id: str | None = None
        self._actions = 0
        self._running: set[Run] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._barrier = ReadBarrier()
        self._writing: set[str] = set()  # outputs of actions still running
        self._by_output: dict[str, Run] = {}
        self._turn = asyncio.Lock()
        self._opening = asyncio.Lock()
        self._bound = False
        self._closing = False

    # -- input ---------------------------------------------------------------------

    def feed(self, message: pb.SessionMessage) -> None:
        """Apply one client message; a broken rule raises GatewayError (abort the session)."""
        for action in message.actions:
            self._dispatch(action)
        for fragment in message.node_fragments:
            self.store.add(fragment)

    def finish_input(self) -> None:
        """The client half-closed: nothing more will arrive (gRPC)."""
        self.store.close_input()

    async def wait_idle(self) -> None:
        """Until every action has ended (or the session failed)."""
        if self._idle.is_set() or self.failed.done():
            return
        idle = asyncio.ensure_future(self._idle.wait())
        waits: list[asyncio.Future[Any]] = [idle, self.failed]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()

    async def close(self) -> None:
        """End the session: cancel running actions, release the core session."""
        self._closing = True
        tasks = [r.task for r in self._running if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        core_id, self.core_id = self.core_id, None
        if core_id is not None:
            await self.service.close(core_id)

    async def _core_session(self) -> str:
        """The core session, opened by the first GENERATE to run and kept alive while the connection is open."""
        async with self._opening:  # concurrent GENERATEs share the one session
            if self.core_id is None:
                self.core_id = (await self.service.open(self.model, pinned=True)).id
            return self.core_id

    def fail(self, error: GatewayError) -> None:
        """Abort the session: the transport sends what is queued, then reports ``error``."""
        if not self.failed.done():
            self.failed.set_result(error)
            self.outbox.put_nowait(None)

    async def finish(self) -> None:
        """After the client half-closed: let the actions end, then mark the end of the output."""
        self.finish_input()
        await self.wait_idle()
        if not self.failed.done():
            self.outbox.put_nowait(None)

    # -- actions ---------------------------------------------------------------------

    def _dispatch(self, action: pb.Action) -> None:
        self._actions += 1
        index = self._actions
        name = action.name.strip().upper()
        label = f"action #{index} {action.name or '(unnamed)'}"  # short: close reasons hold 123 bytes
        limit = self.service.budget.max_actions_in_flight
        if name in ("GENERATE", "DROP") and len(self._running) >= limit:
            raise exhausted(f"{label}: {limit} actions are still running in this session (the limit)")
        if name == "GENERATE":
            self._generate(index, label, action)
        elif name == "DROP":
            self._drop(index, label, action)
        elif name == "CANCEL":
            self._cancel(label, action)
        else:
            raise invalid(f"{label}: unknown action {action.name!r}; this server runs GENERATE, DROP and CANCEL")

    def _start(self, run: Run, work: Coroutine[Any, Any, None]) -> None:
        self._running.add(run)
        self._idle.clear()
        self._writing.update(run.outputs.values())
        run.task = asyncio.create_task(self._guard(run, work))

    def _generate(self, index: int, label: str, action: pb.Action) -> None:
        call = read_generate(action, label, self.service.budget)
        with _labelled(label):
            if call.target and self.service.models.resolve(call.target) != self.model:
                if self._bound:
                    raise invalid(f"target {call.target!r} is not this session's model {self.model!r}")
                self.model = self.service.models.resolve(call.target)
            self._bound = True  # the first GENERATE picks the connection's model (its targetSpec, or the default)
            if "readouts" in call.outputs:
                self.service.readouts(self.model)
        for node_id in call.outputs.values():
            self.store.claim_output(node_id, what=label)
        run = Run(index, call.outputs, label)
        for node_id in call.outputs.values():
            self._by_output[node_id] = run
        self._barrier.opened(index)
        self._start(run, self._run_generate(run, call))

    def _drop(self, index: int, label: str, action: pb.Action) -> None:
        ids = read_ids(action, label, "DROP needs the node ids to forget as inputs")
        run = Run(index, {}, label)
        self._start(run, self._run_drop(run, ids))

    def _cancel(self, label: str, action: pb.Action) -> None:
        ids = read_ids(action, label, "CANCEL needs an output id of the action to stop as input")
        for node_id in ids:
            run = self._by_output.get(node_id)
            if run is None:
                raise not_found(f"{label}: no action writes node {node_id!r}")
            if run.finished or run.cancel_requested or run.task is None:
                continue  # already over: a CANCEL racing the end is not an error
            run.cancel_requested = True
            run.task.cancel()

    async def _guard(self, run: Run, work: Coroutine[Any, Any, None]) -> None:
        """Run one action; its failure aborts the session (spec: no partial failures in v2)."""
        try:
            await work
        except asyncio.CancelledError:
            if self._closing or not run.cancel_requested:
                raise
        except GatewayError as exc:
            self.fail(exc.within(run.label))
        except Exception as exc:
            log.exception("%s failed", run.label)
            self.fail(GatewayError(Code.INTERNAL, f"{run.label}: internal error ({type(exc).__name__})"))
        finally:
            run.finished = True
            self._barrier.read(run.index)
            self._writing.difference_update(run.outputs.values())
            self._running.discard(run)
            if not self._running:
                self._idle.set()

    async def _run_drop(self, run: Run, ids: list[str]) -> None:
        await self._barrier.wait(run.index)  # every earlier GENERATE has read its inputs
        self.store.drop(ids, busy=self._writing)

    async def _run_generate(self, run: Run, call: GenerateCall) -> None:
        generation = Generation.of(call)
        try:
            core_id = await self._core_session()
            await self.store.wait_complete(call.root)
            self.service.budget.check_leaves(self.store.count_leaves(call.root))
            messages = await messages_from_tree(self.store, call.root, self.options.refs)
            self._barrier.read(run.index)
            async with self._turn:
                await generation.run(
                    self.service,
                    core_id,
                    messages,
                    default_max_tokens=self.options.default_max_tokens,
                    store=self.store,
                    outbox=self.outbox,
                    emit=self._emit,
                )
        except asyncio.CancelledError:
            if self._closing or not run.cancel_requested:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            generation.usage["finishReason"] = FinishReason.CANCELLED.value
            text_node = call.outputs["text"]
            tokens = self.store.get(text_node).tokens if text_node in self.store else None
            generation.usage["completionTokens"] = len(tokens or [])
            generation.close(self._emit)

    def _emit(self, fragments: Iterable[pb.NodeFragment]) -> None:
        message = pb.SessionMessage()
        for fragment in fragments:
            self.store.add(fragment, server=True)
            message.node_fragments.append(fragment)
        self.outbox.put_nowait(message)


@contextlib.contextmanager
def _labelled(label: str) -> Iterator[None]:
    """Name the action in a core error raised inside the block (close reasons are short)."""
    try:
        yield
    except GatewayError as exc:
        raise exc.within(label) from None
