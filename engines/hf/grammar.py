"""Structured outputs on the transformers engine: a constraint compiled by llguidance, applied as a token mask.

:class:`Grammars` compiles a request's :class:`~prismgate.core.structured.Structured` for the
model's tokenizer: llguidance translates the schema, regex, choices or grammar into its own
grammar and checks it against the tokenizer under its resource limits (:data:`LIMITS`: the
work is counted in fuel, so a compile ends, with an error, however hostile the grammar). It
runs in a worker thread, never on the event loop, one compile at a time, and each wait is
bounded by ``grammar_compile_timeout_s``. Compiled grammars are kept, least recently used out
first, up to ``grammar_cache_bytes`` of their text. :class:`Constraint` is one request's
matcher: the sampler asks it which tokens may come next and tells it each token chosen.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from prismgate.core.structured import GrammarRefused, Kind, Structured

# llguidance's limits, tighter than its defaults where a request could hold memory or a step for long:
# lexer states take 1-2 kB each; the fuel bounds the work of the compile and of each token's mask
LIMITS: dict[str, Any] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 200_000,
}


class Grammars:
    """Compiles constraints for one model's tokenizer, keeping compiled grammars up to a byte budget."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int], *, cache_bytes: int, timeout_s: float
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_bytes = cache_bytes
        self._hf = tokenizer
        self._tokenizer: Any = None  # llguidance's, built on the compile thread at first use (~1 s for 50k tokens)
        self._cache: OrderedDict[Structured, str] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        # one compile at a time: a compile that outlived its wait holds the thread until it ends
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    async def compile(self, structured: Structured) -> Constraint:
        """A fresh matcher for ``structured``; a grammar the compiler refuses, or one too slow, is INVALID_ARGUMENT."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        future = loop.run_in_executor(self._executor, self._compile, structured)
        try:
            constraint = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            future.add_done_callback(_consume)
            raise self._too_slow(structured) from None
        if loop.time() > deadline:  # ended late, before a busy loop woke this waiter: the limit is the same
            raise self._too_slow(structured)
        return constraint

    def _too_slow(self, structured: Structured) -> GrammarRefused:
        return GrammarRefused(
            f"the {structured.kind.value} constraint took longer than {self.timeout_s:g} s to compile "
            "(grammar_compile_timeout_s); simplify it"
        )

    @property
    def cached(self) -> tuple[int, int]:
        """Compiled grammars kept, and their bytes."""
        with self._lock:
            return len(self._cache), self._cached_bytes

    def _compile(self, structured: Structured) -> Constraint:
        import llguidance

        tokenizer = self._tokenizer or self._build_tokenizer()
        limits = llguidance.LLParserLimits(**LIMITS)
        with self._lock:
            grammar = self._cache.get(structured)
            if grammar is not None:
                self._cache.move_to_end(structured)
        if grammar is None:
            try:
                grammar = _translate(structured)
            except ValueError as exc:
                raise GrammarRefused(f"invalid {structured.kind.value} constraint: {_first_line(exc)}") from None
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits)
            if failed:
                raise GrammarRefused(f"invalid {structured.kind.value} constraint: {_first_line(messages[0])}")
            self._keep(structured, grammar)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise GrammarRefused(f"invalid {structured.kind.value} constraint: {_first_line(matcher.get_error())}")
        return Constraint(matcher, self.vocab_size, self.eos_token_ids)

    def _keep(self, structured: Structured, grammar: str) -> None:
        size = len(grammar.encode()) + structured.size
        if size > self.cache_bytes:
            return
        with self._lock:
            if structured in self._cache:
                return
            self._cache[structured] = grammar
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                old, text = self._cache.popitem(last=False)
                self._cached_bytes -= len(text.encode()) + old.size

    def _build_tokenizer(self) -> Any:
        import llguidance.hf

        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=sorted(self.eos_token_ids)
            )
        except (ValueError, TypeError, AttributeError) as exc:  # llguidance reads fast (Rust) tokenizers only
            raise GrammarRefused(f"this model's tokenizer cannot take structured outputs: {_first_line(exc)}") from None
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class Constraint:
    """One request's place in its grammar: the tokens allowed next, advanced token by token."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.vocab_size = vocab_size
        self.done = False  # the grammar is complete and its end-of-turn token came: the turn ends

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[vocab]`` float32) with every token the grammar forbids next at ``-inf`` (a new tensor).

        A complete grammar allows only the end-of-turn tokens.
        """
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self._matcher.get_error()}")
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        allowed = torch.from_numpy(bits.astype(np.bool_))
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if self._matcher.is_stopped():  # only an end-of-turn token was allowed
            self.done = True
            return
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        self.done = token in self._eos and self._matcher.is_stopped()


def _translate(structured: Structured) -> str:
    """The constraint as llguidance's grammar, as vLLM's guidance backend builds it (JSON compact)."""
    import llguidance

    compact: Any = {"whitespace_flexible": False}
    if structured.kind is Kind.JSON_OBJECT:
        return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact))
    if structured.kind is Kind.JSON_SCHEMA:
        return str(llguidance.LLMatcher.grammar_from_json_schema(structured.source, defaults=compact))
    if structured.kind is Kind.CHOICE:
        return str(llguidance.grammar_from("choice", json.dumps(list(structured.choices))))
    if structured.kind is Kind.REGEX:
        return str(llguidance.grammar_from("regex", structured.source))
    return str(llguidance.grammar_from("grammar", structured.source))  # EBNF (GBNF) or Lark


def _first_line(exc: BaseException | str) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else "unknown error"


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # a compile nobody waits for any more: its error is not "never retrieved"
