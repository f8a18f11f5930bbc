"""Choosing the next token, and the logprobs reported beside it."""

from __future__ import annotations

import torch

from prismgate.core.actions import GenerateSpec


def sample(logits: torch.Tensor, spec: GenerateSpec, generator: torch.Generator) -> int:
    """One token from a ``[vocab]`` float32 row of raw logits.

    Greedy decoding takes the first entry of :func:`logprobs_of`'s list: the largest logprob
    (two logits a rounding apart can share one), the lowest id among equals.
    """
    if spec.temperature == 0 or spec.top_k == 1:
        return int(torch.argmax(torch.log_softmax(logits, dim=-1)))  # argmax gives the first of equal maxima
    scores = logits / spec.temperature
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
