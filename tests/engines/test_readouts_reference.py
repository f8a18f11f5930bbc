"""Readouts checked against an independent computation from transformers' hidden_states."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from prismgate.core.actions import GenerateSpec, PositionRange
from prismgate.core.engine import EngineRequest
from prismgate.core.events import Done, TokenEvent
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.readouts.pack import ConceptPack


async def test_readouts_equal_directions_dot_hidden_states(tiny_model_dir: Path, tiny_pack: Path) -> None:
    pack = ConceptPack.load(tiny_pack)
    assert max(pack.layers) < 2  # hidden_states[L + 1] is layer L's output for every layer but the last
    engine = TransformersEngine(tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, threads=1, prefill_chunk=7)
    await engine.start()
    try:
        tokens = tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": "independent check"}]))
        n = len(tokens)
        request = EngineRequest(
            uuid.uuid4().hex,
            tokens,
            GenerateSpec(max_tokens=5, ignore_eos=True, readout_ranges=(PositionRange(0, n + 5),)),
        )
        events = [e async for e in engine.generate(request) if isinstance(e, TokenEvent)]
    finally:
        await engine.close()
    assert [e.position for e in events] == list(range(n + 5))
    timeline = [e.id for e in events]
    assert tuple(timeline[:n]) == tokens

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([timeline]), output_hidden_states=True).hidden_states
    expected = np.stack(
        [hidden[layer + 1][0].numpy() @ pack.directions[i].T for i, layer in enumerate(pack.layers)], axis=1
    )  # [positions, n_layers, n_concepts]
    got = np.stack([e.readout for e in events])
    assert got.shape == expected.shape == (n + 5, 2, 3)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


async def test_last_layer_readout_is_before_the_final_norm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The convention is the residual stream after layer L, also for the last layer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    last = model.config.num_hidden_layers - 1
    rng = np.random.default_rng(1)
    d = rng.standard_normal((1, 2, model.config.hidden_size)).astype(np.float32)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    pack_path = tmp_path / "last.safetensors"
    ConceptPack(directions=d, layers=(last,), concepts=("a", "b"), model_id="tiny").save(pack_path)
    captured: list[torch.Tensor] = []
    handle = model.model.layers[last].register_forward_hook(
        lambda _m, _a, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    tokens = [5, 6, 7, 8, 9]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    handle.remove()
    expected = captured[0][0].numpy() @ d[0].T

    engine = TransformersEngine(tiny_model_dir, model_id="tiny", concept_pack=pack_path, threads=1)
    await engine.start()
    try:
        request = EngineRequest("r", tuple(tokens), GenerateSpec(max_tokens=0, readout_ranges=(PositionRange(0, 5),)))
        events = [e async for e in engine.generate(request) if not isinstance(e, Done)]
    finally:
        await engine.close()
    got = np.stack([e.readout[0] for e in events])
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
