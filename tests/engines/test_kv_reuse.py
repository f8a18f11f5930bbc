"""The transformers engine's session KV caches: least recently used out, bounded by tokens and bytes."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig

from prismgate.core.actions import Fork
from prismgate.engines.hf.kv_reuse import (
    MAX_BYTES_MAX,
    MAX_BYTES_MIN,
    MAX_FORKS,
    Forks,
    Kept,
    SessionCaches,
    cache_bytes,
    default_max_bytes,
)


def test_the_least_recently_kept_session_goes_first_once_over_the_token_budget() -> None:
    caches = SessionCaches(max_tokens=10)
    caches.keep("a", "cache-a", [1, 2, 3, 4], ())
    caches.keep("b", "cache-b", [5, 6, 7, 8], ())
    assert len(caches) == 2
    caches.keep("c", "cache-c", [9, 10, 11], ())  # 11 tokens: "a" goes
    assert len(caches) == 2 and caches.take("a").cache is None
    assert caches.take("b") == ("cache-b", [5, 6, 7, 8], (), {}, True, None)  # taking hands the cache over...
    assert caches.take("b").cache is None  # ...so a second request cannot write to it too


def test_a_session_alone_over_the_budget_is_kept_and_forget_drops_it() -> None:
    caches = SessionCaches(max_tokens=2)
    caches.keep("big", "cache", [1, 2, 3, 4, 5], ())
    assert len(caches) == 1  # the last turn's cache is what the next turn reuses
    caches.forget("big")
    caches.forget("never-kept")
    assert len(caches) == 0 and caches.take(None).cache is None


def _cache(tokens: int) -> DynamicCache:
    """A real two-layer cache holding ``tokens`` positions (2 heads of 8 float32: 64 bytes per layer each)."""
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=16)
    cache = DynamicCache(config=config)
    for layer in range(2):
        cache.update(torch.zeros(1, 2, tokens, 8), torch.zeros(1, 2, tokens, 8), layer)
    return cache


def test_the_least_recently_kept_session_goes_first_once_over_the_byte_budget() -> None:
    assert cache_bytes(_cache(10)) == 2 * 2 * 10 * 2 * 8 * 4  # layers x (keys, values) x tokens x heads x dims x 4
    caches = SessionCaches(max_tokens=1 << 20, max_bytes=1500)
    caches.keep("a", _cache(2), [1, 2], ())  # 512 bytes each
    caches.keep("b", _cache(2), [3, 4], ())
    assert len(caches) == 2 and caches.bytes == 1024
    caches.keep("c", _cache(2), [5, 6], ())  # 1,536 bytes: "a" goes, though the tokens are few
    assert len(caches) == 2 and caches.take("a").cache is None and caches.bytes == 1024
    caches.take("b")
    assert caches.bytes == 512


def test_a_cropped_cache_counts_the_storage_it_still_holds() -> None:
    cache = _cache(100)
    cache.crop(-90)  # as kv_reuse.resume crops: tokens dropped from the end
    assert cache.get_seq_length() == 10
    assert cache_bytes(cache) == cache_bytes(_cache(100))  # the views keep the whole storage alive


def test_the_default_byte_budget_is_sized_to_the_machine() -> None:
    assert MAX_BYTES_MIN <= default_max_bytes() <= MAX_BYTES_MAX
    assert SessionCaches(10).max_bytes == default_max_bytes()


def test_a_forked_prefill_goes_to_its_followers_and_then_away() -> None:
    caches = SessionCaches(max_tokens=10_000)
    forks = Forks(caches)
    prefilled = Kept(cache=[["keys"]], tokens=[1, 2, 3], steered=(), gates={}, logits=torch.tensor([0.5, 1.5]))
    forks.keep(Fork("a", followers=2), prefilled)
    first, second, third = (forks.take(Fork("a")) for _ in range(3))
    assert first.tokens == second.tokens == [1, 2, 3]
    assert first.cache == [["keys"]] and first.cache is not second.cache  # each follower its own copy
    assert first.logits.tolist() == second.logits.tolist() == [0.5, 1.5]  # and the row to sample from
    assert first.logits is not second.logits
    assert third.cache is None and len(caches) == 0  # the last follower took it: nothing is left behind
    for i in range(MAX_FORKS + 5):  # followers that never come: the oldest prompts are let go
        forks.keep(Fork(f"k{i}", followers=1), prefilled)
    assert len(caches) == MAX_FORKS and forks.take(Fork("k0")).cache is None
