"""Packed bfloat16 weights (engines/hf/packing.py) change no bit of what a client reads.

The same requests (greedy and sampled, steered and gated, deterministic and not, alone and
decoding as a batch, with logprobs and readouts on every position) run on an engine with its
weights packed and on one without; every token, logprob and readout must be equal to the bit.
Where this CPU's oneDNN gives other bits packed, the engine must not have packed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from prismgate.core.actions import PositionRange
from prismgate.core.steering import Comparison, Gate, SteeringEntry
from prismgate.engines.hf import TransformersEngine, packing
from prismgate.engines.hf.loading import load
from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
from prismgate.engines.readouts.pack import DEFAULT_PACKS
from tests.engines.requests import chat, run
from tests.engines.test_determinism import fingerprint

PROMPTS = ["Hi", "Write a haiku about autumn leaves.", "def add(a, b):\n    return a + b", "Quelle heure est-il ?"]


def _bf16_copy(model_dir: Path, target: Path) -> Path:
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return target


def _specs(n: int, layer: int, gate_layer: int, concepts: tuple[str, str]) -> list[dict[str, Any]]:
    every = {
        "max_tokens": 8,
        "ignore_eos": True,
        "logprob_top_k": 5,
        "logprob_ranges": (PositionRange(1, n + 8),),
        "readout_ranges": (PositionRange(0, n + 8),),
    }
    gate = Gate(concept=concepts[1], layer=gate_layer, comparison=Comparison.BELOW, threshold=0)
    return [
        every,
        {**every, "deterministic": True},
        {**every, "steering": (SteeringEntry(layer=layer, scale=6.0, concept=concepts[0]),)},
        {**every, "steering": (SteeringEntry(layer=layer, scale=8.0, concept=concepts[0], gate=gate),)},
        {**every, "temperature": 0.9, "top_p": 0.95, "seed": 1234},
    ]


async def _answers(engine: TransformersEngine, layers: tuple[int, int], concepts: tuple[str, str]) -> list[Any]:
    """Each spec on each prompt, one at a time, then all prompts at once (batched decode steps)."""
    answers = []
    for text in PROMPTS:
        prompt = chat(engine, text)
        for spec in _specs(len(prompt), *layers, concepts):
            events, _ = await run(engine, prompt, **spec)
            answers.append(fingerprint(events))
    prompts = [chat(engine, text) for text in PROMPTS]
    # deterministic: batch-invariant, so the bits cannot depend on which step each one joined
    together = await asyncio.gather(*(run(engine, p, **_specs(len(p), *layers, concepts)[1]) for p in prompts))
    answers += [fingerprint(events) for events, _ in together]
    return answers


async def _compare(model: Path, model_id: str, pack: Path, layers: tuple[int, int], concepts: tuple[str, str]) -> None:
    """``layers``: the steered layer and the gate's; ``concepts``: the steered concept and the gate's."""
    results = {}
    for packed in (True, False):
        engine = TransformersEngine(
            model,
            model_id=model_id,
            concept_pack=pack,
            threads=1,
            dtype="bfloat16",
            device="cpu",
            packed_weights=packed,
            step_target_ms=0,  # chunk sizes from the work alone, not from measured time: the same batches in both runs
        )
        await engine.start()
        try:
            results[packed] = (
                engine.info.packed_layers,
                engine.info.packed_reason,
                await _answers(engine, layers, concepts),
            )
        finally:
            await engine.close()
    layers, reason, answers = results[True]
    assert results[False][:2] == (0, "not packed: packed_weights = false")
    if layers == 0:
        # the check or oneDNN refused (another CPU): nothing changed
        assert reason.startswith(("not packed: packed products of a", "not packed: oneDNN cannot pack here")), reason
        pytest.skip(f"this CPU's oneDNN gives other bits packed: {reason}")
    assert answers == results[False][2]


@pytest.mark.asyncio
async def test_packed_weights_give_the_bits_of_unpacked_ones(
    tiny_model_dir: Path, tiny_pack: Path, tmp_path: Path
) -> None:
    model = _bf16_copy(tiny_model_dir, tmp_path / "tiny-bf16")
    await _compare(model, "tiny-llama", tiny_pack, (1, 0), ("concept0", "concept1"))


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(1200)
async def test_packed_weights_give_the_bits_of_unpacked_ones_on_smollm2() -> None:
    pack = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"
    await _compare(default_model_path(), DEFAULT_MODEL_ID, pack, (16, 12), ("code", "question"))


def _loaded(model: Path) -> Any:
    return load(model, model_id="m", concept_pack=None, device="cpu", dtype="auto", max_model_len=None)


def test_float32_and_the_switch_leave_the_layers_eager(tiny_model_dir: Path) -> None:
    loaded = load(tiny_model_dir, model_id="m", concept_pack=None, device="cpu", dtype="float32", max_model_len=None)
    assert (loaded.info.packed_layers, loaded.info.packed_reason) == (
        0,
        "not packed: the weights are float32; only bfloat16 products are oneDNN's",
    )
    linear = next(m for m in loaded.adapter.model.modules() if type(m) is torch.nn.Linear)
    x = torch.randn(3, linear.in_features)
    assert torch.equal(packing.product(linear)(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    assert packing.pack(torch.nn.Sequential(torch.nn.Linear(4, 4)), enabled=False).reason == (
        "not packed: packed_weights = false"
    )


def test_a_packed_product_with_other_bits_packs_nothing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _bf16_copy(tiny_model_dir, tmp_path / "tiny-bf16")
    here = _loaded(model).info
    if here.packed_layers == 0:
        pytest.skip(here.packed_reason)  # nothing to plant a difference in on this CPU
    honest = packing._packed_product

    def off_by_a_bit(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        product = honest(layer)
        return lambda x: product(x) * (1 + 2**-7) if x.shape[0] == 17 else product(x)  # one row count differs

    monkeypatch.setattr(packing, "_packed_product", off_by_a_bit)
    loaded = _loaded(model)
    assert loaded.info.packed_layers == 0
    assert "at 17 rows differ from the eager ones on this CPU" in loaded.info.packed_reason
    layers = [m for m in loaded.adapter.model.modules() if type(m) is torch.nn.Linear]
    assert not any(hasattr(layer, packing._PRODUCT) for layer in layers)


def test_a_cpu_without_onednns_bf16_path_serves_unpacked(tiny_model_dir: Path, tmp_path: Path) -> None:
    """oneDNN held to AVX2 (as on a CPU without AVX-512) refuses to pack bf16: the model loads unpacked."""
    model = _bf16_copy(tiny_model_dir, tmp_path / "tiny-bf16")
    code = (
        "from pathlib import Path\nfrom prismgate.engines.hf.loading import load\n"
        f"info = load(Path({str(model)!r}), model_id='m', concept_pack=None, device='cpu', dtype='bfloat16',"
        " max_model_len=None).info\n"
        "print(info.packed_layers, info.packed_reason)"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("0 not packed: "), last


def test_a_packed_layer_holds_one_copy_and_refuses_other_input(tiny_model_dir: Path, tmp_path: Path) -> None:
    loaded = _loaded(_bf16_copy(tiny_model_dir, tmp_path / "tiny-bf16"))
    if loaded.info.packed_layers == 0:
        pytest.skip(loaded.info.packed_reason)
    model = loaded.adapter.model
    linear = model.model.layers[0].self_attn.q_proj
    assert linear.weight.is_meta and linear.weight.shape == (linear.out_features, linear.in_features)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.is_meta is not tied  # a tied head keeps the embedding's weight
    assert next(model.parameters()).device.type == "cpu"
    with pytest.raises(TypeError, match=r"takes bfloat16 input without gradients; got torch\.float32"):
        linear(torch.randn(2, linear.in_features))


def test_readyz_says_whether_the_weights_are_packed(live_server: Any) -> None:
    ready = httpx.get(f"{live_server.http_url}/readyz", timeout=30).json()
    packed = ready["packed_weights"]
    assert packed["reason"].startswith(("packed: ", "not packed: ")), packed
    assert (packed["layers"] > 0) == packed["reason"].startswith("packed: ")


def test_siblings_share_one_product_with_each_layers_bits(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Query, key and value (and gate and up) run as one product; each still gets its own bits,
    whichever input it is called with."""
    model = _bf16_copy(tiny_model_dir, tmp_path / "tiny-bf16")
    eager = load(
        model, model_id="m", concept_pack=None, device="cpu", dtype="auto", max_model_len=None, packed_weights=False
    ).adapter.model
    loaded = _loaded(model)
    if loaded.info.packed_layers == 0:
        pytest.skip(loaded.info.packed_reason)
    attention, reference = loaded.adapter.model.model.layers[0].self_attn, eager.model.layers[0].self_attn
    assert all(packing.fused(getattr(attention, name)) for name in ("q_proj", "k_proj", "v_proj"))
    assert not packing.fused(attention.o_proj)
    x, other = (torch.randn(5, attention.q_proj.in_features).to(torch.bfloat16) for _ in range(2))
    with torch.inference_mode():
        for name, given in (("q_proj", x), ("k_proj", x), ("v_proj", other), ("q_proj", other), ("k_proj", x)):
            out = getattr(attention, name)(given)
            assert out.is_contiguous()
            assert torch.equal(out, getattr(reference, name)(given)), name


def test_fused_siblings_with_other_bits_pack_nothing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up check compares each sibling's slice of the shared product with its own layer."""
    model = _bf16_copy(tiny_model_dir, tmp_path / "tiny-bf16")
    if _loaded(model).info.packed_layers == 0:
        pytest.skip("nothing packs on this CPU")
    honest = packing._packed_product
    widths = {sum(layer.out_features for layer in group) for group in _groups(model)}

    def off_in_a_shared_product(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        product = honest(layer)
        if layer.out_features not in widths:
            return product
        return lambda x: product(x) * (1 + 2**-7) if x.shape[0] == 3 else product(x)

    monkeypatch.setattr(packing, "_packed_product", off_in_a_shared_product)
    loaded = _loaded(model)
    assert loaded.info.packed_layers == 0
    assert "at 3 rows differ from the eager ones on this CPU" in loaded.info.packed_reason


def _groups(model: Path) -> list[tuple[torch.nn.Linear, ...]]:
    from collections import Counter

    eager = load(
        model, model_id="m", concept_pack=None, device="cpu", dtype="auto", max_model_len=None, packed_weights=False
    ).adapter.model
    shared = Counter(id(p) for _, p in eager.named_parameters(remove_duplicate=False))
    return packing._sibling_groups(eager, shared)


def test_fused_siblings_run_in_the_invariant_blocks_while_the_switch_is_on() -> None:
    """Deterministic requests need every product in blocks of BLOCK_ROWS rows; the engine does not
    wrap fused siblings again, so their shared product must do it itself."""
    from prismgate.engines.invariant_rows import BLOCK_ROWS, SWITCH

    siblings = tuple(torch.nn.Linear(16, n, bias=False).to(torch.bfloat16) for n in (16, 8))
    try:
        fused = packing.Fused(siblings)
    except RuntimeError as exc:  # a CPU without oneDNN's bf16 path
        pytest.skip(f"oneDNN cannot pack here: {exc}")
    rows: list[int] = []
    honest = fused._product

    def counted(x: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return honest(x)

    fused._product = counted
    x = torch.randn(5, 16).to(torch.bfloat16)
    with torch.inference_mode():
        fused.part(0)(x)
        with SWITCH.on():
            switched = fused.part(1)(torch.randn(13, 16).to(torch.bfloat16))
    assert rows == [5, BLOCK_ROWS, BLOCK_ROWS]
    assert switched.shape == (13, 8)
