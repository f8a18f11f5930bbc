"""The embedded pack's measured steering, checked on real generations (slow: real weights).

``prismgate concepts build`` measured, per concept, a layer and a starting scale on its own few
prompts (:mod:`prismgate.instruments.packs.steering_range`). On a question it never saw, that
layer and scale must still move the concept's readout over the answer (read back unsteered)
and keep the answer fluent by the builder's own measure.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio

from prismgate.core.steering import SteeringEntry
from prismgate.engines.hf import TransformersEngine
from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
from prismgate.engines.readouts.pack import ConceptPack
from prismgate.instruments.packs.build import DEFAULT_PACK
from prismgate.instruments.packs.steering_range import PROMPTS, Runner, fluent_rung

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

QUESTION = "Tell me about your job."
CLEAR = 0.5  # a measured effect of at least half a scale: the concepts the pack says steer clearly


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol() -> Any:
    engine = TransformersEngine(default_model_path(), model_id=DEFAULT_MODEL_ID, concept_pack=DEFAULT_PACK, threads=1)
    await engine.start()
    yield engine
    await engine.close()


async def test_the_measured_layer_and_scale_move_the_readout_and_stay_fluent(smol: Any) -> None:
    assert QUESTION not in PROMPTS
    pack = ConceptPack.load(DEFAULT_PACK)
    assert pack.steering is not None
    clear = {c: r for c, r in pack.steering.items() if r.effect >= CLEAR}
    assert len(clear) >= 3, pack.steering
    runner = Runner(smol, pack)
    prompt = tuple(smol.info.tokenizer.render_chat([{"role": "user", "content": QUESTION}]))
    plain = await runner.answer(prompt, ())
    decode = smol.info.tokenizer.decode
    for concept, measured in clear.items():
        entry = SteeringEntry(layer=measured.layer, scale=measured.scale, concept=concept)
        steered = await runner.answer(prompt, (entry,))
        before, after = runner.read(plain, concept), runner.read(steered, concept)
        said = (concept, decode(plain.tokens), decode(steered.tokens))
        assert steered.tokens != plain.tokens, said
        assert after.readout - before.readout > 0, (after.readout - before.readout, *said)  # toward the concept
        assert fluent_rung([after], [before]), (after.logprob, before.logprob, after.distinct, *said)
