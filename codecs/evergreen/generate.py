"""One GENERATE, from a complete input tree to closed output nodes.

The tree becomes chat messages (:mod:`.prompt`); the core plans the turn (what of the
conversation the session already holds, ``max_tokens``, the context fit) and runs it;
this module only writes the events into the output nodes, waiting for the reader
between tokens (:class:`~prismgate.codecs.evergreen.outbox.Outbox`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prismgate.codecs.evergreen import outputs
from prismgate.codecs.evergreen.actions import GenerateCall
from prismgate.codecs.evergreen.fragments import NodeWriter
from prismgate.codecs.evergreen.nodes import NodeStore
from prismgate.codecs.evergreen.outbox import Outbox
from prismgate.core.chat import Message
from prismgate.core.events import Done, TokenEvent
from prismgate.core.prompts import Messages
from prismgate.core.service import SessionService
from prismgate.core.turns import ChatTurn
from prismgate.schemas import evergreen_pb2 as pb

ORIGIN = "evergreen"

Emit = Callable[[Iterable[pb.NodeFragment]], None]


@dataclass(slots=True)
class Generation:
    """The output side of one GENERATE: its writers and the usage object it ends with."""

    call: GenerateCall
    writers: dict[str, NodeWriter]
    usage: dict[str, Any]

    @classmethod
    def of(cls, call: GenerateCall) -> Generation:
        return cls(call, outputs.writers(call.outputs), {})

    async def run(
        self,
        service: SessionService,
        core_id: str,
        messages: list[Message],
        *,
        default_max_tokens: int,
        store: NodeStore,
        outbox: Outbox,
        emit: Emit,
    ) -> None:
        call, outs = self.call, self.writers
        turn = await service.plan_turn(
            ChatTurn(
                prompt=Messages(messages, chat_template=call.chat_template),
                origin=ORIGIN,
                sampling=call.sampling,
                max_tokens=call.max_tokens,
                default_max_tokens=default_max_tokens,
                logprobs="logprobs" in outs,
                readouts="readouts" in outs,
            ),
            session_id=core_id,
        )
        self.usage.update(outputs.planned_usage(turn))
        info = service.info(turn.model)
        if "readouts" in outs:
            header = outputs.readout_header(info.model_id, service.readouts(info.model_id), call.readout_binary)
            emit([outs["readouts"].chunk(header)])
        features = turn.action.spec.features
        if "features" in outs and features is not None:
            emit([outs["features"].chunk(outputs.features_header(info.model_id, features))])
        generated: list[int] = []
        text_node = outs["text"].id
        async for event in service.run_turn(turn):
            if isinstance(event, TokenEvent):
                if event.is_prefill:
                    continue
                index = len(generated)
                generated.append(event.id)
                if text_node in store:  # generated text keeps its ids, so a later turn reuses them exactly
                    store.get(text_node).tokens = list(generated)
                fragments: list[pb.NodeFragment] = []
                if event.text:
                    fragments.append(outs["text"].chunk(event.text.encode()))
                if "readouts" in outs and event.readout is not None:
                    fragments.append(outs["readouts"].chunk(outputs.readout_line(index, event, call.readout_binary)))
                if "features" in outs and event.features is not None:
                    fragments.append(outs["features"].chunk(outputs.features_line(index, event, info.features)))
                if "logprobs" in outs and event.logprob is not None:
                    fragments.append(
                        outs["logprobs"].chunk(outputs.logprob_line(index, event, info.tokenizer, call.logprobs_binary))
                    )
                if fragments:
                    emit(fragments)
                    await outbox.wait_for_room()  # backpressure: the engine waits for the reader
            elif isinstance(event, Done):
                self.usage.update(outputs.done_usage(event))
                self.close(emit, final_text=event.text or "")

    def close(self, emit: Emit, final_text: str = "") -> None:
        """Close every output not closed yet (``usage`` gets its object, ``text`` the held-back text)."""
        fragments = []
        for key, out in self.writers.items():
            if out.closed:
                continue
            if key == "usage":
                fragments.append(out.close(outputs.usage_bytes(self.usage)))
            elif key == "text":
                fragments.append(out.close(final_text.encode()))
            else:
                fragments.append(out.close())
        if fragments:
            emit(fragments)
