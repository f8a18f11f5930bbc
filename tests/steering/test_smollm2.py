"""Steering the default model toward ``french`` with its committed pack (slow: real weights)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from prismgate.core.actions import PositionRange
from prismgate.core.steering import Positions, SteeringEntry
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
from prismgate.engines.readouts.pack import DEFAULT_PACKS
from tests.engines.requests import run

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LAYER = 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol() -> Any:
    pack = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"
    engine = TransformersEngine(default_model_path(), model_id=DEFAULT_MODEL_ID, concept_pack=pack, threads=1)
    await engine.start()
    yield engine
    await engine.close()


async def test_steering_toward_french_raises_the_french_readout_downstream_and_changes_the_answer(smol: Any) -> None:
    prompt = tuple(smol.info.tokenizer.render_chat([{"role": "user", "content": "Tell me about your favourite food."}]))
    n = len(prompt)
    ask = {"max_tokens": 20, "readout_ranges": (PositionRange(1, n + 20),)}
    plain, _ = await run(smol, prompt, **ask)
    french = SteeringEntry(layer=LAYER, scale=24.0, concept="french", positions=Positions.BOTH)
    steered, _ = await run(smol, prompt, **ask, steering=(french,))

    manifest = smol.info.readouts
    c = manifest.concepts.index("french")

    def leaning(events: list[Any]) -> np.ndarray:
        """Mean ``value - center`` of ``french`` per layer, over the prompt (position 0 aside)."""
        values = np.stack([e.readout[:, c] for e in events if 1 <= e.position < n])
        return values.mean(axis=0) - np.array([row[c] for row in manifest.centers])

    before, after = leaning(plain), leaning(steered)
    first = manifest.layers.index(LAYER)
    assert np.allclose(before[:first], after[:first])  # earlier layers cannot see it
    assert (after[first:] - before[first:] > 10).all(), (before, after)  # this layer and every later one
    # English text, read as English at every layer; steered, read as French at layers 12 to 22
    assert (before < 0).all() and (after[first : first + 4] > 0).all()
    plain_text = smol.info.tokenizer.decode([e.id for e in plain if not e.is_prefill])
    steered_text = smol.info.tokenizer.decode([e.id for e in steered if not e.is_prefill])
    assert plain_text != steered_text, steered_text
