"""Choosing the next token, and the logprobs reported beside it.

The order is vLLM's: the raw logits get ``logit_bias`` and the ``min_tokens`` mask, then the
repetition, frequency and presence penalties (:class:`History`), then a structured-output
grammar's mask (:class:`~prismgate.engines.hf.grammar.Constraint`); greedy decoding takes the
argmax of that; sampling divides by the temperature, applies ``min_p``, then top-k and top-p.
Logprobs are always of the raw logits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from prismgate.core.actions import GenerateSpec
from prismgate.engines.hf.grammar import Constraint


class History:
    """The tokens a request's penalties and ``min_tokens`` read, kept as per-id counts.

    Built once per request (its prompt), then told each decoded token: a step costs a few
    vocabulary-sized operations, never a pass over the whole timeline.
    """

    def __init__(self, spec: GenerateSpec, prompt: Sequence[int], vocab: int, eos_token_ids: Collection[int]) -> None:
        self.spec = spec
        self.generated = 0
        self.stop_ids = torch.tensor(sorted(spec.stop_ids(eos_token_ids)), dtype=torch.long)
        self.bias_ids = torch.tensor([t for t, _ in spec.logit_bias], dtype=torch.long)
        self.bias = torch.tensor([b for _, b in spec.logit_bias], dtype=torch.float32)
        penalised = spec.presence_penalty or spec.frequency_penalty or spec.repetition_penalty != 1.0
        self.counts = torch.zeros(vocab, dtype=torch.float32) if penalised else None  # generated, per id
        self.seen = torch.zeros(vocab, dtype=torch.bool) if penalised else None  # prompt or generated
        if self.seen is not None and prompt:
            self.seen[torch.tensor(list(prompt), dtype=torch.long)] = True

    def add(self, token: int) -> None:
        self.generated += 1
        if self.counts is not None and self.seen is not None:
            self.counts[token] += 1
            self.seen[token] = True

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The ``[vocab]`` float32 logits with the bias, the ``min_tokens`` mask and the penalties applied."""
        spec = self.spec
        if not spec.shapes_logits:
            return logits
        out = logits.clone()
        if len(self.bias_ids):
            out.index_add_(0, self.bias_ids, self.bias)
        if self.generated < spec.min_tokens and len(self.stop_ids):
            out[self.stop_ids] = float("-inf")
        if self.seen is not None and spec.repetition_penalty != 1.0:
            scaled = torch.where(out > 0, out / spec.repetition_penalty, out * spec.repetition_penalty)
            out = torch.where(self.seen, scaled, out)
        if self.counts is not None:
            if spec.frequency_penalty:
                out -= spec.frequency_penalty * self.counts
            if spec.presence_penalty:
                out -= spec.presence_penalty * (self.counts > 0).to(torch.float32)
        return out


def sample(
    logits: torch.Tensor,
    spec: GenerateSpec,
    generator: torch.Generator,
    history: History | None = None,
    constraint: Constraint | None = None,
) -> int:
    """One token from a ``[vocab]`` float32 row of raw logits (shaped by ``history``, masked by ``constraint``).

    Where the shaping leaves the grammar nothing (``min_tokens`` masks the stop token a complete
    grammar needs), the grammar wins: its mask applies to the raw logits.

    Greedy decoding takes the argmax of the shaped logits' logprobs; unshaped, that is the first
    entry of :func:`logprobs_of`'s list: the largest logprob (two logits a rounding apart can
    share one), the lowest id among equals.
    """
    raw = logits
    if history is not None:
        logits = history.shape(logits)
    if constraint is not None:
        masked = constraint.mask(logits)
        if not bool(torch.isfinite(masked).any()) and history is not None:
            masked = constraint.mask(raw)
        logits = masked
    if spec.temperature == 0 or spec.top_k == 1:
        return int(torch.argmax(torch.log_softmax(logits, dim=-1)))  # argmax gives the first of equal maxima
    scores = logits / spec.temperature
    if spec.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < probs.max() * spec.min_p, float("-inf"))
    if spec.top_k > 0:
        k = min(spec.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = torch.cumsum(probs, dim=-1) - probs >= spec.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprobs_of(logits: torch.Tensor, token_id: int, top_k: int) -> tuple[float, list[tuple[int, float]] | None]:
    """The raw-distribution logprob of ``token_id`` and the ``top_k`` best alternatives."""
    logp = torch.log_softmax(logits, dim=-1)
    own = float(logp[token_id])
    if top_k <= 0:
        return own, None
    ids = top_ids(logp, top_k)
    return own, [(int(i), float(v)) for i, v in zip(ids.tolist(), logp[ids].tolist(), strict=True)]


def top_ids(logp: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most likely ids, most likely first and the lowest id first among equals.

    ``torch.topk`` leaves the order of equal values (and which of them make the cut) to the
    kernel; the list a client reads, and the greedy token at its head, must not depend on that.
    """
    kth = torch.topk(logp, k).values[-1]
    candidates = torch.nonzero(logp >= kth).flatten()  # ascending ids
    order = torch.sort(logp[candidates], descending=True, stable=True).indices[:k]
    return candidates[order]
