"""The batch-invariant kernels on their own: attention row by row, the switch, and "off" changes nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from prismgate.engines.hf import invariant
from prismgate.engines.hf.adapters import load_adapter
from prismgate.engines.invariant_rows import SWITCH, matmul_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gives_a_query_the_same_bits_alone_batched_padded_and_in_a_chunk(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, length = 9, 3, 64, 150
    keys = torch.randn(1, kv_heads, length, dim).to(dtype)
    values = torch.randn(1, kv_heads, length, dim).to(dtype)
    queries = torch.randn(1, heads, length, dim).to(dtype)
    # the last position decoded alone: one query over every key, no mask
    alone, _ = invariant.invariant_attention(None, queries[:, :, -1:], keys, values, None, scaling=0.125)
    # the same position as the last query of a prefill chunk of 40 (a causal mask)
    chunk = 40
    causal = torch.ones(chunk, length, dtype=torch.bool).tril(length - chunk)[None, None]
    prefill, _ = invariant.invariant_attention(None, queries[:, :, -chunk:], keys, values, causal, scaling=0.125)
    assert torch.equal(prefill[:, -1], alone[:, 0])
    # inside a batch of 4 decodes, left-padded to the longest (213 keys) with other rows around it
    width = 213
    batch_k, batch_v = torch.randn(4, kv_heads, width, dim).to(dtype), torch.randn(4, kv_heads, width, dim).to(dtype)
    batch_q = torch.randn(4, heads, 1, dim).to(dtype)
    batch_k[2, :, width - length :], batch_v[2, :, width - length :], batch_q[2] = (
        keys[0],
        values[0],
        queries[0, :, -1:],
    )
    mask = torch.ones(4, 1, 1, width, dtype=torch.bool)
    mask[2, :, :, : width - length] = False
    mask[0, :, :, :10] = False
    batched, _ = invariant.invariant_attention(None, batch_q, batch_k, batch_v, mask, scaling=0.125)
    assert torch.equal(batched[2], alone[0])


def test_the_switch_is_per_thread() -> None:
    seen: list[bool] = []
    with SWITCH.on():
        thread = threading.Thread(target=lambda: seen.append(SWITCH.active))
        thread.start()
        thread.join()
        assert SWITCH.active
    assert seen == [False] and not SWITCH.active


def test_products_of_few_rows_are_padded_only_while_the_switch_is_on() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(8, 576), torch.randn(576, 8)
    with SWITCH.on():
        assert torch.equal(matmul_rows(x[:1], w)[0], matmul_rows(x, w)[0])
    assert matmul_rows(x[:1], w).shape == (1, 8)


def test_with_the_switch_off_the_installed_model_computes_what_it_did_before(tiny_model_dir: Path) -> None:
    """Bit for bit: a prompt and one row's decode step over a short context both run SDPA
    (decode attention takes batches and long contexts: tests/engines/test_decode_attention.py)."""
    plain = load_adapter(tiny_model_dir, device="cpu", dtype="float32")
    installed = load_adapter(tiny_model_dir, device="cpu", dtype="float32")
    assert invariant.install(installed.model)
    ids = list(range(5, 40))
    with torch.inference_mode():
        results = []
        for adapter in (plain, installed):
            cache = adapter.new_cache()
            first = adapter.forward(ids[:-1], cache, 0, ids, [], list(range(len(ids) - 1)))
            results.append((first, adapter.forward(ids[-1:], cache, len(ids) - 1, ids, [], [0])))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_the_engine_refuses_deterministic_requests_off_the_cpu(tiny_model_dir: Path) -> None:
    # On an H100 a chunked prefill gave readouts other bits than a whole one (cuBLAS picks kernels
    # by shape); the refusal is decided before any kernel is installed, so a CPU-held model
    # labelled for CUDA shows it here; on the CPU the start-up check decides (on the GPU machine's
    # CPU, torch 2.11, it refused too: "logits of a prompt prefilled in one chunk and in chunks of 3 differ").
    from prismgate.engines.hf import loading
    from prismgate.engines.hf.adapters import ModelAdapter

    adapter = load_adapter(tiny_model_dir, device="cpu", dtype="float32")
    on_gpu = ModelAdapter(adapter.model, adapter.tokenizer, "cuda:0")
    assert loading._invariance(on_gpu) == loading.CPU_ONLY
    assert "VLLM_BATCH_INVARIANT=1" in loading.CPU_ONLY
    assert loading._invariance(adapter) != loading.CPU_ONLY
