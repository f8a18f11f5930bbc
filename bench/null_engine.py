"""An Engine that produces tokens at no cost: benchmarks only, never shipped in the package.

Driving the gateway with it measures the gateway's own ceiling (codecs, core, event loop):
every microsecond a stream takes is spent outside the model. It honours the Engine contract
(TokenEvents then one Done, cancellation on close, ``in_flight``) so that every codec runs
its real code paths. It never emits EOS: each generation runs exactly ``max_tokens``.

The tokenizer is the tiny test model's byte-level one (no files needed), so detokenizing
protocols (Evergreen, OpenAI) release one character per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import numpy as np

from prismgate.core.actions import covered
from prismgate.core.engine import EngineInfo, EngineRequest, ReadoutManifest
from prismgate.core.errors import Code, GatewayError
from prismgate.core.events import Done, Event, FinishReason, TokenEvent
from prismgate.core.health import LOADING, READY, Health
from prismgate.engines.tokenizer import HFTokenizer

NULL_MODEL_ID = "null"


class NullEngine:
    """Yields ``max_tokens`` tokens as fast as the consumer takes them.

    ``yield_every`` is how many tokens pass between ``await asyncio.sleep(0)``: 1 gives
    every stream a turn on the event loop after each token, as a real engine's queue does.
    """

    def __init__(
        self,
        *,
        model_id: str = NULL_MODEL_ID,
        max_model_len: int = 1 << 20,
        readouts: tuple[int, int] | None = (2, 3),
        yield_every: int = 1,
        readout_values: str = "zeros",
    ) -> None:
        """``readout_values``: ``zeros``, or ``random`` (a cycle of 64 seeded normal arrays x 10,
        float32 values with full-length decimals, as a real model's: what printing them costs)."""
        from tests.tiny_model import build_tokenizer

        self.model_id = model_id
        self._hf = build_tokenizer()
        self._max_model_len = max_model_len
        self._readout_shape = readouts
        self._readout_values = readout_values
        self.yield_every = max(1, yield_every)
        self._active = 0
        self.info: EngineInfo = None  # type: ignore[assignment]  # set by start()
        self.stats = {"prefilled_tokens": 0, "reused_tokens": 0, "decoded_tokens": 0}
        # ASCII letters: every token releases one character of text
        self._cycle = [t for t in self._hf.encode("abcdefghijklmnopqrstuvwxyz") if t is not None]

    async def start(self) -> None:
        manifest = None
        if self._readout_shape is not None:
            n_layers, n_concepts = self._readout_shape
            manifest = ReadoutManifest(
                concepts=tuple(f"concept{i}" for i in range(n_concepts)),
                layers=tuple(range(n_layers)),
                hidden_size=128,
            )
        self.info = EngineInfo(
            model_id=self.model_id,
            max_model_len=self._max_model_len,
            vocab_size=len(self._hf),
            eos_token_ids=(int(self._hf.eos_token_id),),
            tokenizer=HFTokenizer(self._hf),
            readouts=manifest,
            engine_name="null",
        )

    def _readouts(self, shape: tuple[int, ...] | None) -> list[np.ndarray]:
        if shape is None:
            return []
        if self._readout_values == "zeros":
            return [np.zeros(shape, dtype=np.float32)]
        rng = np.random.default_rng(0)
        return [(rng.standard_normal(shape) * 10).astype(np.float32) for _ in range(64)]

    async def close(self) -> None:
        return None

    def health(self) -> Health:
        return LOADING if self.info is None else READY

    def image_tokens(self, data: bytes, mime: str) -> int:
        raise GatewayError(Code.FAILED_PRECONDITION, "the null engine takes no images")

    def release(self, session_key: str) -> None:
        return None

    def in_flight(self) -> int:
        return self._active

    async def generate(self, request: EngineRequest) -> AsyncGenerator[Event, None]:
        spec = request.spec
        n = len(request.tokens)
        shape = self.info.readouts.shape if self.info.readouts is not None else None
        readouts = self._readouts(shape)
        readout = readouts[0] if readouts else None
        self._active += 1
        self.stats["prefilled_tokens"] += n
        generated = 0
        finish = FinishReason.LENGTH
        try:
            for p in range(n):  # prefill events only where a client asked to see them
                lp = covered(spec.logprob_ranges, p)
                ro = readout is not None and covered(spec.readout_ranges, p)
                if lp or ro:
                    yield TokenEvent(
                        id=request.tokens[p],
                        position=p,
                        is_prefill=True,
                        logprob=-1.0 if lp and p > 0 else None,
                        readout=readout if ro else None,
                    )
            for i in range(spec.max_tokens):
                position = n + i
                token = self._cycle[i % len(self._cycle)]
                event = TokenEvent(id=token, position=position, is_prefill=False)
                if covered(spec.logprob_ranges, position):
                    event.logprob = -1.0
                    if spec.logprob_top_k:
                        event.top_logprobs = [(token, -1.0)] * spec.logprob_top_k
                if readout is not None and covered(spec.readout_ranges, position):
                    event.readout = readouts[position % len(readouts)]
                generated += 1
                self.stats["decoded_tokens"] += 1
                yield event
                if generated % self.yield_every == 0:
                    await asyncio.sleep(0)
            yield Done(prompt_tokens=n, completion_tokens=generated, finish_reason=finish, prefilled_tokens=n)
        finally:
            self._active -= 1
