"""The engine's Llama layer forward (engines/hf/llama_layer.py) gives transformers' bits wherever the engine runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from prismgate.engines.hf import llama_layer
from prismgate.engines.hf.batch_cache import BatchCache
from prismgate.engines.hf.loading import load
from prismgate.engines.invariant_rows import SWITCH


def _load(model_dir: Path, dtype: str, *, lean: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as patch:
        if not lean:
            patch.setattr(llama_layer, "install", lambda model: "layers: transformers' forward (off for the test)")
        return load(model_dir, model_id="m", concept_pack=None, device="cpu", dtype=dtype, max_model_len=None).adapter


def _lean(adapter: Any) -> bool:
    return all("lean_forward" in layer.forward.__qualname__ for layer in adapter.model.model.layers)


def _run(adapter: Any) -> list[torch.Tensor]:
    """A prompt in chunks, one row's decode steps, a batch of three at other lengths (left-padded),
    and a prompt and a decode step with the batch-invariant switch on; every layer's output, through a hook."""
    outputs: list[torch.Tensor] = []
    handle = adapter.model.model.layers[1].register_forward_hook(lambda _m, _a, out: outputs.append(out.clone()))
    with torch.inference_mode():
        caches = []
        for row, length in enumerate((37, 12, 5)):
            cache = adapter.new_cache()
            ids = [(7 * i + row) % 200 + 3 for i in range(length)]
            for start in range(0, length, 16):
                part = ids[start : start + 16]
                outputs.append(adapter.forward(part, cache, start, ids, [], list(range(len(part)))))
            caches.append(cache)
        for step in range(3):
            outputs.append(adapter.forward([50 + step], caches[0], 37 + step, [], [], [0]))
        batch = BatchCache(adapter)
        for step in range(3):
            outputs.append(batch.step([60 + step, 61, 62], caches, [40 + step, 12 + step, 5 + step]))
        batch.leave_all()
        with SWITCH.on():
            cache = adapter.new_cache()
            outputs.append(adapter.forward(list(range(3, 24)), cache, 0, [], [], list(range(21))))
            outputs.append(adapter.forward([9], cache, 21, [], [], [0]))
    handle.remove()
    return outputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_it_gives_transformers_bits_in_prompts_decode_steps_batches_and_under_the_switch(
    tiny_model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 runs each projection apart; bfloat16 reads the packed siblings' one product where this CPU packs."""
    theirs = _load(tiny_model_dir, dtype, lean=False, monkeypatch=monkeypatch)
    ours = _load(tiny_model_dir, dtype, lean=True, monkeypatch=monkeypatch)
    assert _lean(ours) and not _lean(theirs)
    want, got = _run(theirs), _run(ours)
    assert len(want) == len(got) == 26
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), index


def test_a_forward_that_gives_other_bits_is_not_installed(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = _load(tiny_model_dir, "float32", lean=False, monkeypatch=monkeypatch)
    right = llama_layer._rotate
    monkeypatch.setattr(llama_layer, "_rotate", lambda x, cos, sin: right(x, cos, sin) * (1 + 2**-20))
    said = llama_layer.install(adapter.model)
    assert said == "layers: transformers' forward (its outputs differ from transformers' on this machine)"
    assert not _lean(adapter)
    monkeypatch.setattr(llama_layer, "_rotate", right)
    assert llama_layer.install(adapter.model) == "layers: prismgate's Llama forward (the same bits as transformers')"
    assert _lean(adapter)


def test_other_families_keep_transformers_forward(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = _load(tiny_model_dir, "float32", lean=False, monkeypatch=monkeypatch)
    adapter.model.model.layers[0].__class__ = type("OtherLayer", (type(adapter.model.model.layers[0]),), {})
    assert llama_layer.install(adapter.model) == "layers: transformers' forward (not a Llama model)"
    assert not any("lean_forward" in layer.forward.__qualname__ for layer in adapter.model.model.layers)
