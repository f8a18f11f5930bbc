"""The transformers engine's session KV caches: least recently used out, bounded by tokens."""

from __future__ import annotations

from prismgate.engines.hf.kv_reuse import SessionCaches


def test_the_least_recently_kept_session_goes_first_once_over_the_token_budget() -> None:
    caches = SessionCaches(max_tokens=10)
    caches.keep("a", "cache-a", [1, 2, 3, 4], ())
    caches.keep("b", "cache-b", [5, 6, 7, 8], ())
    assert len(caches) == 2
    caches.keep("c", "cache-c", [9, 10, 11], ())  # 11 tokens: "a" goes
    assert len(caches) == 2 and caches.take("a").cache is None
    assert caches.take("b") == ("cache-b", [5, 6, 7, 8], (), {}, True)  # taking hands the cache over...
    assert caches.take("b").cache is None  # ...so a second request cannot write to it too


def test_a_session_alone_over_the_budget_is_kept_and_forget_drops_it() -> None:
    caches = SessionCaches(max_tokens=2)
    caches.keep("big", "cache", [1, 2, 3, 4, 5], ())
    assert len(caches) == 1  # the last turn's cache is what the next turn reuses
    caches.forget("big")
    caches.forget("never-kept")
    assert len(caches) == 0 and caches.take(None).cache is None
