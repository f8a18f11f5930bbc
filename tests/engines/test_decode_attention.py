"""Decode attention on CPU (engines/hf/decode_attention.py) is as accurate as SDPA, and used only where it may be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prismgate.engines.hf import decode_attention as da


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """float64 attention, GQA by repeating keys: ``[batch, 1, heads, d]``."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = (q.double() @ k64.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~seen, float("-inf"))
    return (torch.softmax(scores, -1) @ v64).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per head"])
def test_it_is_as_accurate_as_sdpa(dtype: torch.dtype, heads: int, kv_heads: int, mask_kind: str) -> None:
    torch.manual_seed(0)
    batch, keys, dim = 3, 70, 64
    q = (torch.randn(batch, heads, 1, dim) * 3).to(dtype)
    k, v = (torch.randn(batch, kv_heads, keys, dim).to(dtype) for _ in range(2))
    seen = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    seen[1, ..., :20] = False  # a left-padded row
    seen[2, ..., :5] = False
    mask: torch.Tensor | None = {
        "none": None,
        "bool": seen,
        "additive": torch.zeros(batch, 1, 1, keys).masked_fill(~seen, torch.finfo(torch.float32).min),
        "per head": seen.expand(batch, heads, 1, keys),
    }[mask_kind]
    if mask is None:
        seen = torch.ones_like(seen)
    want = _reference(q, k, v, seen)
    ours = da.decode_attention(q, k, v, mask, None)
    group = heads // kv_heads
    sdpa = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=seen
    ).transpose(1, 2)
    assert ours.shape == (batch, 1, heads, dim) and ours.dtype == dtype and ours.is_contiguous()
    our_error = (ours.double() - want).abs().max().item()
    sdpa_error = (sdpa.double() - want).abs().max().item()
    assert our_error <= max(sdpa_error, 1e-6) * 1.01, (our_error, sdpa_error)


def test_it_takes_decode_steps_in_batches_or_over_long_contexts_on_cpu_with_a_plain_softmax() -> None:
    short, long = torch.zeros(1, 2, 40, 8), torch.zeros(1, 2, da.MIN_KEYS_ALONE, 8)
    one, batch, two = torch.zeros(1, 4, 1, 8), torch.zeros(3, 4, 1, 8), torch.zeros(1, 4, 2, 8)
    assert da.takes(one, long, {"scaling": 0.1, "dropout": 0.0})
    assert da.takes(batch, short.expand(3, -1, -1, -1), {})
    assert not da.takes(one, short, {})  # one row over a short context: SDPA as transformers calls it
    assert not da.takes(two, long, {})  # a prefill chunk: SDPA
    assert not da.takes(one, long, {"softcap": 50.0})
    assert not da.takes(one, long, {"s_aux": torch.zeros(2)})
    assert not da.takes(torch.zeros(1, 3, 1, 8), long, {})  # query heads that are no multiple of the key heads
    assert da.takes(one, long, {"softcap": None, "s_aux": None})


def test_the_engines_decode_steps_come_here(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from prismgate.engines.hf.batch_cache import BatchCache
    from prismgate.engines.hf.loading import load

    adapter = load(
        tiny_model_dir, model_id="m", concept_pack=None, device="cpu", dtype="auto", max_model_len=None
    ).adapter
    calls: list[tuple[int, ...]] = []
    real = da.decode_attention

    def spy(query: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(query.shape))
        return real(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(da, "decode_attention", spy)
    layers = adapter.model.config.num_hidden_layers
    with torch.inference_mode():
        caches = []
        for row in range(2):
            cache = adapter.new_cache()
            adapter.forward([5 + row, 6, 7, 8], cache, 0, [], [], [3])
            caches.append(cache)
        assert calls == []  # prompts: SDPA
        adapter.forward([9], caches[0], 4, [], [], [0])
        assert calls == []  # one row over 5 keys: SDPA as transformers calls it
        BatchCache(adapter).step([10, 10], caches, [5, 4])
    assert len(calls) == layers and calls[0][:3] == (2, calls[0][1], 1)
