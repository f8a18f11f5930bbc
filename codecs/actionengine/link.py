"""One ActionEngine client on an Evergreen session: its actions, their settings, their statuses.

The session (:class:`~prismgate.codecs.evergreen.session.EvergreenSession`) does the work;
this adds what ActionEngine's conventions need on top:

* a GENERATE with a ``config`` input waits until that node completes, then runs with the
  node's JSON as its ``GenerateConfig`` (the ``Struct`` form of an Evergreen config: same
  fields, same checks, same refusals);
* the client's half-close (an empty message) lets every action end, then is answered with
  an empty message, as the library's server answers it;
* a failure is written to every unfinished action (:meth:`Writer.failure`) before the
  transport closes.
"""

from __future__ import annotations

import asyncio
import contextlib

from google.protobuf import any_pb2, json_format, struct_pb2

from prismgate.codecs import json_input
from prismgate.codecs.actionengine.translate import Call, Inbound, Writer
from prismgate.codecs.actionengine.wire import Form
from prismgate.codecs.evergreen.config import STRUCT_TYPE_URL
from prismgate.codecs.evergreen.prompt import Mime
from prismgate.codecs.evergreen.session import EvergreenSession
from prismgate.core.errors import GatewayError, invalid
from prismgate.schemas import evergreen_pb2 as pb

CONFIG_MIMES = ("application/json", "text/plain")


class Link:
    def __init__(self, session: EvergreenSession, form: Form) -> None:
        self.session = session
        self.writer = Writer(form)
        self.half_closed = False
        self._configuring: set[asyncio.Task[None]] = set()

    def feed(self, message: Inbound) -> None:
        """Apply one decoded frame: its actions (those with a config wait for it), then its fragments."""
        if self.half_closed:
            raise invalid("a message after the client's half-close")
        ready = pb.SessionMessage()
        for call in message.calls:
            self.writer.track(call)
            if call.config is None:
                ready.actions.append(call.action)
            else:
                task = asyncio.create_task(self._configure(call, call.config))
                self._configuring.add(task)
                task.add_done_callback(self._configuring.discard)
        ready.node_fragments.extend(message.fragments.node_fragments)
        self.session.feed(ready)
        if message.half_close:
            self.half_closed = True

    async def finish(self) -> None:
        """After the half-close: held actions get their config or fail, running ones end, the output ends."""
        self.session.finish_input()
        await asyncio.gather(*self._configuring, return_exceptions=True)
        await self.session.finish()

    async def close(self) -> None:
        for task in list(self._configuring):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._configuring, return_exceptions=True)

    async def _configure(self, call: Call, node_id: str) -> None:
        label = f"action {call.id!r} {call.action.name}"
        try:
            config = await self._read_config(node_id, label)
            call.action.configs.append(config)
            self.session.feed(pb.SessionMessage(actions=[call.action]))
        except GatewayError as exc:
            self.session.fail(exc)

    async def _read_config(self, node_id: str, label: str) -> any_pb2.Any:
        """The config node's JSON object, measured before it is joined and parsed."""
        store = self.session.store
        await store.wait_complete(node_id)
        leaves = list(store.leaves(node_id))
        chunks = [c for leaf in leaves for c in leaf.chunks()]
        size = sum(len(c.data) for c in chunks)
        self.session.service.budget.check_config_bytes(size, f"{label}: config")
        for leaf in leaves:
            mime = Mime.parse(leaf.metadata.mimetype if leaf.metadata else "").essence
            if mime not in CONFIG_MIMES:
                raise invalid(f"{label}: config chunks are {' or '.join(CONFIG_MIMES)} (JSON), not {mime!r}")
        raw = b"".join(c.data for c in chunks)
        value = await json_input.loads_off_loop(raw, self.session.service.budget, f"{label}: config")
        if not isinstance(value, dict):
            raise invalid(f"{label}: config must be a JSON object, got {type(value).__name__}")
        struct = struct_pb2.Struct()
        json_format.ParseDict(value, struct)
        return any_pb2.Any(type_url=STRUCT_TYPE_URL, value=struct.SerializeToString())
