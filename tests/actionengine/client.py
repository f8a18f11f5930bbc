"""The real ActionEngine client (PyPI ``action-engine``), used as its docs show, against a live gateway.

Reads are bounded inside the library (``timeout=`` on each read): a read that timed out in
a worker thread would otherwise keep that thread, and the test run, waiting for ever.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import actionengine

READ_TIMEOUT_S = 60.0

# the gateway's NDJSON and JSON outputs: the library decodes a chunk only for a mimetype it
# knows, and registering a deserializer needs a serializer for the same mimetype first
OUTPUT_MIMES = (
    "application/x-ndjson; schema=prismgate.readouts.v1",
    "application/x-ndjson; schema=prismgate.logprobs.v1",
    "application/x-ndjson; schema=prismgate.features.v1",
    "application/json; schema=prismgate.usage.v1",
)


def register_output_mimes() -> None:
    registry = actionengine.data.get_global_serializer_registry()
    for mime in OUTPUT_MIMES:
        registry.register_serializer(mime, lambda value: json.dumps(value).encode(), dict)
        registry.register_deserializer(mime, lambda raw: json.loads(raw), dict)


class Client:
    """One stream (one gateway session) and the registry of the GENERATE shapes a test uses."""

    def __init__(self, port: int, token: str | None = None) -> None:
        target = "/evergreen" + (f"?access_token={token}" if token else "")
        self.registry = actionengine.ActionRegistry()
        self.node_map = actionengine.NodeMap()
        self.stream = actionengine.websockets.make_websocket_stream("127.0.0.1", target, port)
        self.stream.start()
        self.session = actionengine.Session(self.node_map, self.registry)
        self.session.dispatch_from(self.stream)
        self._shapes: set[str] = set()

    def _shape(self, outputs: Sequence[str], config: bool) -> str:
        key = "GENERATE:" + ",".join(outputs) + (":config" if config else "")
        if key not in self._shapes:
            inputs = [("prompt", "text/plain")] + ([("config", "application/json")] if config else [])
            schema = actionengine.ActionSchema(
                name="GENERATE", inputs=inputs, outputs=[(name, "application/octet-stream") for name in outputs]
            )
            self.registry.register(key, schema)
            self._shapes.add(key)
        return key

    async def generate(
        self,
        prompt: str | Sequence[tuple[str, str]],
        config: dict[str, Any] | None = None,
        outputs: Sequence[str] = ("response",),
    ) -> actionengine.Action:
        """Call GENERATE, send its config and prompt (text, or (role, text) chunks), return the action."""
        key = self._shape(outputs, config is not None)
        action = self.registry.make_action(
            key, str(uuid.uuid4()), node_map=self.node_map, stream=self.stream, session=self.session
        )
        await action.call()
        if config is not None:
            await action["config"].put_and_finalize(config)
        if isinstance(prompt, str):
            await action["prompt"].put_and_finalize(prompt)
        else:
            for role, text in prompt:
                metadata = actionengine.ChunkMetadata(mimetype="text/plain")
                metadata.set_attribute("role", role)
                await action["prompt"].put(actionengine.Chunk(metadata=metadata, data=text.encode()))
            await action["prompt"].finalize()
        return action

    def close(self) -> None:
        self.stream.half_close()


async def read_all(node: Any, within_s: float = READ_TIMEOUT_S) -> list[Any]:
    """Every item of an output node, in order, until its end (each read bounded inside the library)."""
    items = []
    while (item := await node.next(within_s)) is not None:
        items.append(item)
    return items
