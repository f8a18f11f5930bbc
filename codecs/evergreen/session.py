"""One Evergreen session, independent of its transport (WebSocket or gRPC stream).

The transport feeds decoded ``SessionMessage``s to :meth:`EvergreenSession.feed`, drains
:attr:`EvergreenSession.outbox`, and ends the session when :attr:`failed` resolves (the
abort convention, see :mod:`prismgate.codecs.evergreen.errors`). Each connection holds one
core session (``service.open``), whose token timeline is the running conversation: every
GENERATE renders its whole input tree, and only the part past the longest shared prefix is
appended, so a follow-up turn prefills just its delta.

Actions:

* ``GENERATE``: waits until its input tree is complete, renders it, streams the outputs;
  GENERATEs run one at a time in the order their inputs become ready;
* ``DROP`` (extension): forgets the named nodes (and descendants nothing else holds) once
  every earlier action has read its inputs;
* ``CANCEL`` (extension): stops the action that writes the named output; its outputs are
  closed with what they have and the session goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prismgate.codecs.evergreen.config import parse_configs
from prismgate.codecs.evergreen.nodes import Limits, NodeStore
from prismgate.codecs.evergreen.payloads import RefPolicy
from prismgate.codecs.evergreen.prompt import messages_from_tree
from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.chat import plan_append, render
from prismgate.core.errors import Code, GatewayError, invalid, not_found
from prismgate.core.events import Done, FinishReason, TokenEvent
from prismgate.core.service import SessionService
from prismgate.schemas import evergreen_generate_pb2 as gpb
from prismgate.schemas import evergreen_pb2 as pb

log = logging.getLogger(__name__)

ORIGIN = "evergreen"
TEXT_MIME = "text/plain"
OUTPUT_ROLE = "assistant"
READOUTS_MIME = "application/x-ndjson; schema=prismgate.readouts.v1"
LOGPROBS_MIME = "application/x-ndjson; schema=prismgate.logprobs.v1"
USAGE_MIME = "application/json; schema=prismgate.usage.v1"

INPUT_NAMES = ("prompt", "text")
TEXT_OUTPUTS = ("response", "text")
EXTRA_OUTPUTS = ("readouts", "logprobs", "usage")


@dataclass(frozen=True, slots=True)
class Options:
    limits: Limits = field(default_factory=Limits)
    refs: RefPolicy = field(default_factory=RefPolicy)
    default_max_tokens: int = 256
    model: str | None = None


@dataclass(eq=False)
class Run:
    """One action in flight."""

    index: int
    name: str
    outputs: dict[str, str]  # output name -> node id
    label: str
    resolved: asyncio.Future[None]
    task: asyncio.Task[None] | None = None
    cancel_requested: bool = False
    finished: bool = False


class _Output:
    """Writes one output node as a stream of fragments (and mirrors them into the store)."""

    def __init__(self, node_id: str, mimetype: str, role: str = "") -> None:
        self.id = node_id
        self.metadata = pb.ChunkMetadata(mimetype=mimetype, role=role)
        self.seq = 0
        self.closed = False

    def chunk(self, data: bytes, *, final: bool = False) -> pb.NodeFragment:
        fragment = pb.NodeFragment(id=self.id, seq=self.seq, continued=not final)
        fragment.chunk_fragment.data = data
        if self.seq == 0:
            fragment.chunk_fragment.metadata.CopyFrom(self.metadata)
        self.seq += 1
        self.closed = final
        return fragment

    def close(self, data: bytes = b"") -> pb.NodeFragment:
        """The final fragment: with data (or, at seq 0, the metadata), else an empty terminator."""
        if data or self.seq == 0:
            return self.chunk(data, final=True)
        fragment = pb.NodeFragment(id=self.id, seq=self.seq, continued=False)
        self.seq += 1
        self.closed = True
        return fragment


class Outbox:
    """Messages for the transport, in order; ``None`` marks the end.

    Putting never blocks (aborts and closing fragments must always get through), but a
    generation waits in :meth:`wait_for_room` while the transport has ``limit`` messages
    unsent, so a client that stops reading pauses the engine instead of filling memory.
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._queue: asyncio.Queue[pb.SessionMessage | None] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()

    def put_nowait(self, message: pb.SessionMessage | None) -> None:
        self._queue.put_nowait(message)
        if self._queue.qsize() >= self.limit:
            self._room.clear()

    async def get(self) -> pb.SessionMessage | None:
        message = await self._queue.get()
        if self._queue.qsize() < self.limit:
            self._room.set()
        return message

    async def wait_for_room(self) -> None:
        await self._room.wait()

    def qsize(self) -> int:
        return self._queue.qsize()


class EvergreenSession:
    def __init__(self, service: SessionService, options: Options | None = None) -> None:
        self.service = service
        self.options = options or Options()
        self.store = NodeStore(self.options.limits)
        # What to send, in order; ``None`` marks the end (after a failure, or when the input
        # ended and every action finished): the transport stops there.
        self.outbox = Outbox()
        self.failed: asyncio.Future[GatewayError] = asyncio.get_running_loop().create_future()
        self.model = service.check_model(self.options.model or service.pool.default_model)
        self.core_id = service.open(self.model).id
        self._runs: list[Run] = []
        self._by_output: dict[str, Run] = {}
        self._turn = asyncio.Lock()
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
        while True:
            pending = [r.task for r in self._runs if r.task is not None and not r.task.done()]
            if not pending or self.failed.done():
                return
            waits: list[asyncio.Future[Any]] = [*pending, self.failed]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)

    async def close(self) -> None:
        """End the session: cancel running actions, release the core session."""
        self._closing = True
        tasks = [r.task for r in self._runs if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.service.close(self.core_id)

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
        index = len(self._runs) + 1
        name = action.name.strip().upper()
        label = f"action #{index} {action.name or '(unnamed)'}"  # short: close reasons hold 123 bytes
        if name == "GENERATE":
            self._generate(index, label, action)
        elif name == "DROP":
            self._drop(index, label, action)
        elif name == "CANCEL":
            self._cancel(label, action)
        else:
            raise invalid(f"{label}: unknown action {action.name!r}; this server runs GENERATE, DROP and CANCEL")

    def _new_run(self, index: int, name: str, label: str, outputs: dict[str, str]) -> Run:
        run = Run(index, name, outputs, label, asyncio.get_running_loop().create_future())
        self._runs.append(run)
        return run

    def _generate(self, index: int, label: str, action: pb.Action) -> None:
        inputs = [(p.name, p.id) for p in action.inputs]
        unknown_in = [n for n, _ in inputs if n not in INPUT_NAMES]
        if unknown_in:
            raise invalid(f"{label}: unknown input {unknown_in[0]!r}; GENERATE takes 'prompt' or 'text'")
        if len(inputs) != 1:
            raise invalid(f"{label}: GENERATE takes exactly one input ('prompt' or 'text'), got {len(inputs)}")
        outputs: dict[str, str] = {}
        for p in action.outputs:
            if p.name not in TEXT_OUTPUTS + EXTRA_OUTPUTS:
                raise invalid(
                    f"{label}: unknown output {p.name!r}; GENERATE writes 'response' or 'text', "
                    "and optionally 'readouts', 'logprobs', 'usage'"
                )
            key = "text" if p.name in TEXT_OUTPUTS else p.name
            if key in outputs:
                raise invalid(f"{label}: output {p.name!r} named twice")
            outputs[key] = p.id
        if "text" not in outputs:
            raise invalid(f"{label}: GENERATE needs a 'response' (or 'text') output")
        if len(set(outputs.values())) != len(outputs):
            raise invalid(f"{label}: two outputs share one node id")
        config = parse_configs(action.configs, label)
        target = action.target_spec.id
        if target and self.service.check_model(target) != self.model:
            raise invalid(f"{label}: target {target!r} is not this session's model {self.model!r}")
        info = self.service.info(self.model)
        if "readouts" in outputs and info.readouts is None:
            raise invalid(f"{label}: model {self.model!r} has no concept pack loaded, so it has no readouts")
        _spec(config, max_tokens=1, prompt_len=1, logprobs=False, readouts=False)  # value checks, now
        for node_id in outputs.values():
            self.store.claim_output(node_id, what=label)
        run = self._new_run(index, "GENERATE", label, outputs)
        for node_id in outputs.values():
            self._by_output[node_id] = run
        run.task = asyncio.create_task(self._guard(run, self._run_generate(run, inputs[0][1], config)))

    def _drop(self, index: int, label: str, action: pb.Action) -> None:
        ids = [p.id for p in action.inputs]
        if not ids:
            raise invalid(f"{label}: DROP needs the node ids to forget as inputs")
        run = self._new_run(index, "DROP", label, {})
        earlier = [r.resolved for r in self._runs if r is not run and not r.resolved.done()]
        run.task = asyncio.create_task(self._guard(run, self._run_drop(run, ids, earlier)))

    def _cancel(self, label: str, action: pb.Action) -> None:
        ids = [p.id for p in action.inputs]
        if not ids:
            raise invalid(f"{label}: CANCEL needs an output id of the action to stop as input")
        for node_id in ids:
            run = self._by_output.get(node_id)
            if run is None:
                raise not_found(f"{label}: no action writes node {node_id!r}")
            if run.finished or run.cancel_requested or run.task is None:
                continue  # already over: a CANCEL racing the end is not an error
            run.cancel_requested = True
            run.task.cancel()

    async def _guard(self, run: Run, work: Any) -> None:
        """Run one action; its failure aborts the session (spec: no partial failures in v2)."""
        try:
            await work
        except asyncio.CancelledError:
            if self._closing or not run.cancel_requested:
                raise
        except GatewayError as exc:
            self.fail(GatewayError(exc.code, _prefixed(run.label, exc.message)))
        except Exception as exc:
            log.exception("%s failed", run.label)
            self.fail(GatewayError(Code.INTERNAL, f"{run.label}: internal error ({type(exc).__name__})"))
        finally:
            run.finished = True
            if not run.resolved.done():
                run.resolved.set_result(None)

    async def _run_drop(self, run: Run, ids: list[str], earlier: list[asyncio.Future[None]]) -> None:
        if earlier:
            await asyncio.gather(*earlier)
        busy = {nid for r in self._runs if not r.finished for nid in r.outputs.values()}
        self.store.drop(ids, busy=busy)

    async def _run_generate(self, run: Run, root: str, config: gpb.GenerateConfig) -> None:
        outs = {key: _Output(node_id, *_mime_of(key)) for key, node_id in run.outputs.items()}
        usage: dict[str, Any] = {}
        try:
            await self.store.wait_complete(root)
            messages = await messages_from_tree(self.store, root, self.options.refs)
            run.resolved.set_result(None)
            async with self._turn:
                await self._decode(run, messages, config, outs, usage)
        except asyncio.CancelledError:
            if self._closing or not run.cancel_requested:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            usage["finishReason"] = FinishReason.CANCELLED.value
            text_node = outs["text"].id
            usage["completionTokens"] = len(self.store.get(text_node).tokens or []) if text_node in self.store else 0
            self._close_outputs(outs, usage)

    async def _decode(
        self,
        run: Run,
        messages: list[Any],
        config: gpb.GenerateConfig,
        outs: dict[str, _Output],
        usage: dict[str, Any],
    ) -> None:
        service = self.service
        info = service.info(self.model)
        chat_template = config.chat_template if config.HasField("chat_template") else True
        prompt = render(service, messages, model=self.model, chat_template=chat_template)
        core = service.session(self.core_id)
        plan = plan_append(core.tokens, core.images, prompt)
        prompt_len = len(prompt.tokens)
        if config.HasField("max_tokens"):
            max_tokens = config.max_tokens
        else:
            room = info.max_model_len - prompt_len
            max_tokens = min(self.options.default_max_tokens, room) if room > 0 else self.options.default_max_tokens
        spec = _spec(
            config,
            max_tokens=max_tokens,
            prompt_len=prompt_len,
            logprobs="logprobs" in outs,
            readouts="readouts" in outs,
        )
        action = GenerateAction(
            append_tokens=plan.tokens,
            images=plan.images,
            offset=plan.offset,
            truncating=plan.truncating,
            spec=spec,
            detokenize=True,
            origin=ORIGIN,
        )
        usage.update(promptTokens=prompt_len, reusedTokens=plan.offset, appendedTokens=len(plan.tokens))
        if "readouts" in outs and info.readouts is not None:
            m = info.readouts
            header = {
                "model": info.model_id,
                "concepts": list(m.concepts),
                "layers": list(m.layers),
                "layerConvention": m.layer_convention,
                "shape": ["layers", "concepts"],
                "centers": None if m.centers is None else [[_num(v) for v in row] for row in m.centers],
            }
            self._emit([outs["readouts"].chunk(_line(header))], run)
        generated: list[int] = []
        tokenizer = info.tokenizer
        async for event in service.generate(self.core_id, action):
            if isinstance(event, TokenEvent):
                if event.is_prefill:
                    continue
                index = len(generated)
                generated.append(event.id)
                self._store_tokens(outs["text"].id, generated)
                fragments: list[pb.NodeFragment] = []
                if event.text:
                    fragments.append(outs["text"].chunk(event.text.encode()))
                if "readouts" in outs and event.readout is not None:
                    values = [[_num(v) for v in row] for row in event.readout.tolist()]
                    fragments.append(
                        outs["readouts"].chunk(
                            _line(
                                {
                                    "index": index,
                                    "position": event.position,
                                    "tokenId": event.id,
                                    "text": event.text or "",
                                    "values": values,
                                }
                            )
                        )
                    )
                if "logprobs" in outs and event.logprob is not None:
                    top = [
                        {"tokenId": t, "text": tokenizer.token_text(t), "logprob": _num(lp)}
                        for t, lp in (event.top_logprobs or [])
                    ]
                    fragments.append(
                        outs["logprobs"].chunk(
                            _line(
                                {
                                    "index": index,
                                    "position": event.position,
                                    "tokenId": event.id,
                                    "text": event.text or "",
                                    "logprob": _num(event.logprob),
                                    "top": top,
                                }
                            )
                        )
                    )
                if fragments:
                    self._emit(fragments, run)
                    await self.outbox.wait_for_room()  # backpressure: the engine waits for the reader
            elif isinstance(event, Done):
                usage.update(_usage(event))
                self._close_outputs(outs, usage, final_text=event.text or "")

    def _store_tokens(self, node_id: str, generated: list[int]) -> None:
        if node_id in self.store:
            self.store.get(node_id).tokens = list(generated)

    def _close_outputs(self, outs: dict[str, _Output], usage: dict[str, Any], final_text: str = "") -> None:
        fragments = []
        for key, out in outs.items():
            if out.closed:
                continue
            if key == "usage":
                fragments.append(out.close(json.dumps(usage, separators=(",", ":")).encode()))
            elif key == "text":
                fragments.append(out.close(final_text.encode()))
            else:
                fragments.append(out.close())
        if fragments:
            self._emit(fragments, None)

    def _emit(self, fragments: Iterable[pb.NodeFragment], run: Run | None) -> None:
        message = pb.SessionMessage()
        for fragment in fragments:
            self.store.add(fragment, server=True)
            message.node_fragments.append(fragment)
        self.outbox.put_nowait(message)


def _mime_of(key: str) -> tuple[str, str]:
    return {
        "text": (TEXT_MIME, OUTPUT_ROLE),
        "readouts": (READOUTS_MIME, ""),
        "logprobs": (LOGPROBS_MIME, ""),
        "usage": (USAGE_MIME, ""),
    }[key]


def _spec(
    config: gpb.GenerateConfig, *, max_tokens: int, prompt_len: int, logprobs: bool, readouts: bool
) -> GenerateSpec:
    """GenerateConfig -> the core's GenerateSpec (logprobs and readouts cover the generated tokens)."""
    generated = (PositionRange(prompt_len, prompt_len + max(max_tokens, 0)),)
    return GenerateSpec(
        max_tokens=max_tokens,
        temperature=config.temperature if config.HasField("temperature") else 0.0,
        top_p=config.top_p if config.HasField("top_p") else 1.0,
        top_k=config.top_k if config.HasField("top_k") else 0,
        seed=config.seed if config.HasField("seed") else None,
        stop_token_ids=tuple(config.stop_token_ids),
        stop_strings=tuple(config.stop_strings),
        ignore_eos=config.ignore_eos,
        logprob_ranges=generated if logprobs else (),
        logprob_top_k=config.top_logprobs,
        readout_ranges=generated if readouts else (),
        priority=config.priority,
    )


def _usage(done: Done) -> dict[str, Any]:
    out: dict[str, Any] = {
        "finishReason": done.finish_reason.value,
        "promptTokens": done.prompt_tokens,
        "completionTokens": done.completion_tokens,
        "cachedTokens": done.cached_tokens,
        "prefilledTokens": done.prefilled_tokens,
    }
    if done.stop_string is not None:
        out["stopString"] = done.stop_string
    return out


def _line(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def _num(value: float) -> float | None:
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        return None
    return float(f"{v:.6g}")


def _prefixed(label: str, message: str) -> str:
    return message if message.startswith(label) else f"{label}: {message}"
