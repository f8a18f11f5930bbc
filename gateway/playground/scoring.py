"""``POST /playground/score``: the readouts, logprobs and SAE features of a conversation's prompt tokens.

Evergreen's GENERATE streams readouts for the tokens it generates, not for the prompt, and the
page cannot tokenize. So, beside each answer, the page sends the conversation as it stands
(every earlier answer with the exact token ids the model produced, as Evergreen keeps them) and
gets back every token of its rendering with that token's readouts and logprob: a prefill-only
run through the core on a throw-away timeline. Rendering is :func:`prismgate.core.chat.render`,
the one Evergreen uses, so positions and tokens are the ones the model saw; a token's readouts
depend only on the tokens before it, so they are the values the session computed.

Hostile input: the body is read up to :data:`MAX_BODY_BYTES` and no further, then parsed,
counted and typed off the event loop before anything is rendered, rendering and encoding the
answer run off the event loop too, and the run
goes through the engine pool's admission and the core's context checks like any generation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from starlette.requests import Request

from prismgate.codecs.features import token_features
from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.chat import Message, TextPart, render
from prismgate.core.engine import Tokenizer
from prismgate.core.errors import Code, GatewayError, invalid
from prismgate.core.events import Readout, TokenEvent
from prismgate.core.features import FeatureManifest, FeatureSpec
from prismgate.core.service import SessionService
from prismgate.playground.features import TOP_K

MAX_BODY_BYTES = 1 << 20
MAX_MESSAGES = 512
ROLES = ("system", "user", "assistant")


async def read_body(request: Request) -> bytes:
    """The body, refused once it passes :data:`MAX_BODY_BYTES` (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise BodyTooLarge()
    return bytes(body)


class BodyTooLarge(GatewayError):
    """RESOURCE_EXHAUSTED, answered 413: the size of what was sent, not the server's load."""

    def __init__(self) -> None:
        super().__init__(Code.RESOURCE_EXHAUSTED, f"the body is over {MAX_BODY_BYTES} bytes")


def parse_messages(body: bytes) -> list[Message]:
    """``{"messages": [{"role", "content", "tokens"?}]}`` -> core messages, every field checked."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"the body is not JSON: {exc}") from None
    raw = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list")
    if len(raw) > MAX_MESSAGES:
        raise invalid(f"'messages' has {len(raw)} entries; at most {MAX_MESSAGES}")
    messages = []
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(item, dict) or item.get("role") not in ROLES or not isinstance(item.get("content"), str):
            raise invalid(f"{where} must be {{'role': one of {', '.join(ROLES)}, 'content': a string}}")
        tokens = item.get("tokens")
        if tokens is not None and (
            not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
        ):
            raise invalid(f"{where}.tokens must be a list of token ids")
        messages.append(Message(item["role"], [TextPart(item["content"], tuple(tokens) if tokens else None)]))
    return messages


async def score(service: SessionService, messages: Sequence[Message]) -> bytes:
    """Every token of the rendered conversation with its logprob and readouts (position 0 has neither), as JSON.

    Rendering before the run and encoding after it (a readout table per token: up to the whole
    context times layers times concepts) happen on a worker thread, not on the event loop.
    """
    prompt = await asyncio.to_thread(render, service.models, messages)
    info = service.info()
    n = len(prompt.tokens)
    covered = (PositionRange(1, n),) if n > 1 else ()
    spec = GenerateSpec(
        max_tokens=0,
        logprob_ranges=covered,
        readout_ranges=covered if info.readouts is not None else (),
        features=None if info.features is None else FeatureSpec(TOP_K, info.features.layers, ranges=covered),
    )
    action = GenerateAction(append_tokens=prompt.tokens, spec=spec, origin="playground")
    by_position: dict[int, TokenEvent] = {}
    async for event in service.run(action):
        if isinstance(event, TokenEvent):
            by_position[event.position] = event
    return await asyncio.to_thread(_encode, info.tokenizer, prompt.tokens, by_position, info.features)


def _encode(
    tokenizer: Tokenizer, ids: Sequence[int], by_position: dict[int, TokenEvent], manifest: FeatureManifest | None
) -> bytes:
    tokens = []
    for position, token_id in enumerate(ids):
        seen = by_position.get(position)
        text = tokenizer.token_text(token_id)
        record = {
            "position": position,
            "tokenId": token_id,
            "text": text,
            "logprob": None if seen is None else seen.logprob,
            "values": None if seen is None or seen.readout is None else _float32s(seen.readout),
        }
        if seen is not None and seen.features is not None:  # each SAE layer's top features, as Evergreen writes them
            record["layers"] = token_features(position, token_id, text, seen.features, manifest)["layers"]
        tokens.append(record)
    return json.dumps({"tokens": tokens}, separators=(",", ":")).encode()


def _float32s(readout: Readout) -> list[list[float]]:
    """float32 values at the 7 significant digits they hold (not float64's 17): half the bytes on the wire."""
    return [[float(f"{v:.7g}") for v in row] for row in readout.tolist()]
