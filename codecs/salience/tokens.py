"""salience.tokens.v1.Tokens: text to token ids and back, with the served model's own tokenizer.

Salience speaks ids only, so without this a client needs a local copy of the tokenizer (and
of the chat template, which must match the gateway's exactly for KV reuse and for readouts to
mean what they say). Each RPC checks its sizes against the core's budget first (the prompt-bytes
rule of :class:`~prismgate.core.budget.RequestBudget`, and at most a context of ids), then
tokenizes in a worker thread: tokenizing costs time in proportion to the input, and the event
loop serves every other stream meanwhile. The work itself is the core's: the same encoding
and chat rendering a prompt gets (:func:`~prismgate.core.prompts.build_prompt`,
:func:`~prismgate.core.chat.render`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from prismgate.core.chat import Message, TextPart, render
from prismgate.core.checks import check_vocabulary
from prismgate.core.engine import EngineInfo
from prismgate.core.errors import invalid
from prismgate.core.prompts import Messages, Text, build_prompt
from prismgate.core.service import SessionService
from prismgate.core.token_texts import TokenTexts
from prismgate.schemas import salience_tokens_pb2 as pb
from prismgate.schemas import salience_tokens_pb2_grpc as pb_grpc


class TokensServicer(pb_grpc.TokensServicer):
    def __init__(self, service: SessionService) -> None:
        self.service = service

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        info = self.service.info(request.model or None)
        source = Text(request.text)
        self.service.budget.check_prompt(source, info.max_model_len)
        prompt = await asyncio.to_thread(build_prompt, self.service.models, info.model_id, source)
        return pb.TokenizeResponse(ids=prompt.tokens)

    async def RenderChat(
        self, request: pb.RenderChatRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenderChatResponse:
        info = self.service.info(request.model or None)
        if len(request.messages) > info.max_model_len:  # every message renders to at least one token
            raise invalid(
                f"{len(request.messages)} messages cannot fit the model's context of {info.max_model_len} tokens"
            )
        messages = [Message(m.role, [TextPart(m.content)]) for m in request.messages]
        self.service.budget.check_prompt(Messages(messages), info.max_model_len)
        prompt = await asyncio.to_thread(
            render,
            self.service.models,
            messages,
            model=info.model_id,
            add_generation_prompt=request.add_generation_prompt,
        )
        return pb.RenderChatResponse(ids=prompt.tokens)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        info = self.service.info(request.model or None)
        ids = list(request.ids)
        if len(ids) > info.max_model_len:
            raise invalid(f"{len(ids)} ids; the limit is the model's context of {info.max_model_len} tokens")
        check_vocabulary(info, ids)
        text, pieces = await asyncio.to_thread(_detokenize, info, self.service.token_texts(info.model_id), ids)
        return pb.DetokenizeResponse(
            text=text, token_texts=[t for t, _ in pieces], token_bytes=[bytes(b) for _, b in pieces]
        )


def _detokenize(info: EngineInfo, texts: TokenTexts, ids: Sequence[int]) -> tuple[str, list[tuple[str, list[int]]]]:
    return info.tokenizer.decode(ids), [texts.get(i) for i in ids]
