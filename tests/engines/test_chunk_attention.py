"""A prompt chunk's attention on CPU (engines/hf/chunk_attention.py): transformers' SDPA bits without its copies."""

from __future__ import annotations

import pytest
import torch

from prismgate.engines.hf import chunk_attention as ca


class _Module(torch.nn.Module):
    """What transformers' SDPA path reads off an attention layer."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.num_key_value_groups = group
        self.is_causal = True


def _chunk_mask(batch: int, queries: int, keys: int, padded: int) -> torch.Tensor:
    """A chunk's causal mask after a cached prefix, the first ``padded`` keys of row 1 hidden."""
    seen = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    mask = seen.expand(batch, 1, queries, keys).clone()
    if batch > 1:
        mask[1, :, :, :padded] = False
    return mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("queries", "prefix"), [(2, 5), (32, 300), (96, 1000)])
@pytest.mark.parametrize("batch", [1, 2])
def test_it_gives_the_bits_of_transformers_sdpa_path(dtype: torch.dtype, queries: int, prefix: int, batch: int) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(queries + prefix)
    heads, kv_heads, dim, keys = 9, 3, 64, prefix + queries
    q = torch.randn(batch, heads, queries, dim).to(dtype)
    k, v = (torch.randn(batch, kv_heads, keys, dim).to(dtype) for _ in range(2))
    mask = _chunk_mask(batch, queries, keys, padded=7)
    module = _Module(heads // kv_heads)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.1)
    ours = ca.chunk_attention(q, k, v, mask, 0.1)
    assert ours.shape == (batch, queries, heads, dim) and ours.dtype == dtype and ours.is_contiguous()
    assert torch.equal(ours, want)
    other = _chunk_mask(batch, queries, keys, padded=11)  # a new mask of the same shape: not the memo's
    want, _ = sdpa_attention_forward(module, q, k, v, other, scaling=0.1)
    assert torch.equal(ca.chunk_attention(q, k, v, other, 0.1), want)


def test_it_takes_masked_chunks_over_grouped_heads_on_cpu_with_a_plain_softmax() -> None:
    module = _Module(2).eval()
    chunk, one = torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 1, 8)
    grouped, full = torch.zeros(1, 2, 10, 8), torch.zeros(1, 4, 10, 8)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    assert ca.takes(module, chunk, grouped, mask, {"dropout": 0.0, "scaling": 0.3})
    assert not ca.takes(module, chunk, grouped, None, {})  # no mask: transformers uses GQA itself
    assert not ca.takes(module, one, grouped, mask, {})  # a decode row
    assert not ca.takes(module, chunk, full, mask, {})  # no grouped heads: nothing is copied
    assert not ca.takes(module, chunk, grouped, mask, {"softcap": 30.0})
    assert not ca.takes(module, chunk, grouped, mask, {"s_aux": torch.zeros(4)})
    assert not ca.takes(module, chunk, grouped, mask, {"position_bias": torch.zeros(1)})
    assert not ca.takes(module, chunk, grouped, mask, {"dropout": 0.1})
    assert ca.takes(module, chunk, grouped, mask, {"softcap": None, "s_aux": None, "position_bias": None})
    assert not ca.takes(module.train(), chunk, grouped, mask, {})  # training: dropout is the model's


def test_the_engines_chunks_come_here_with_the_same_logits(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from prismgate.engines.hf.loading import load

    adapter = load(
        tiny_model_dir, model_id="m", concept_pack=None, device="cpu", dtype="auto", max_model_len=None
    ).adapter
    prompt = [5 + i % 40 for i in range(60)]

    def chunked() -> torch.Tensor:
        cache = adapter.new_cache()
        adapter.forward(prompt[:20], cache, 0, [], [], [19])
        return adapter.forward(prompt[20:], cache, 20, [], [], list(range(40)))

    calls: list[tuple[int, ...]] = []
    real = ca.chunk_attention

    def spy(query: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(query.shape))
        return real(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ca, "chunk_attention", spy)
    with torch.inference_mode():
        ours = chunked()
        layers = adapter.model.config.num_hidden_layers
        assert len(calls) == layers and calls[0][2] == 40  # the second chunk's layers, not the first's
        monkeypatch.setattr(ca, "takes", lambda *args: False)  # transformers' own SDPA path
        theirs = chunked()
    assert len(calls) == layers
    assert torch.equal(ours, theirs)
