"""Steering on the vLLM engine, on its compiled path: what the transformers engine computes,
per row in a batch, and never served from blocks computed under other steering.

vLLM runs with its default compilation (on CPU: Dynamo and Inductor), so the vectors are
added by the in-graph op. Tolerances are the cross-check's (:mod:`.test_vllm_crosscheck`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prismgate.core.actions import PositionRange
from prismgate.core.errors import Code, GatewayError
from prismgate.core.steering import Comparison, Gate, Positions, SteeringEntry
from prismgate.engines.vllm import capture, steer
from prismgate.engines.vllm.steer_rows import SteeredRows, SteerWriter
from tests.engines.requests import run
from tests.engines.test_vllm_crosscheck import assert_compiled, compare, pair
from tests.engines.test_vllm_parts import _Model
from tests.engines.vllm_factory import make_vllm_engine, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

MAX = 12


@pytest.fixture
def engines(tiny_pair: Any) -> Any:
    """The module's transformers and vLLM engines (tests/engines/conftest.py)."""
    return tiny_pair


def push(scale: float, *, layer: int = 0, concept: str = "concept1", **kw: Any) -> SteeringEntry:
    return SteeringEntry(layer=layer, scale=scale, concept=concept, **kw)


def raw(scale: float, *, layer: int = 1, **kw: Any) -> SteeringEntry:
    direction = tuple(float(x) for x in np.random.default_rng(7).standard_normal(128))
    return SteeringEntry(layer=layer, scale=scale, direction=direction, **kw)


MIXED = (
    push(6.0),
    push(0.5, layer=1, concept="concept2", norm_match=True, positions=Positions.GENERATED),
    raw(-4.0, positions=Positions.PROMPT),
    push(2.0),
)


def prompt(engine: Any, text: str, length: int = 0) -> tuple[int, ...]:
    ids = tuple(engine.info.tokenizer.render_chat([{"role": "user", "content": text}]))
    return ids if len(ids) >= length else (ids * (length // len(ids) + 1))[:length]


def spec(p: tuple[int, ...], *steering: SteeringEntry, max_tokens: int = MAX) -> dict[str, Any]:
    n = len(p)
    return {
        "max_tokens": max_tokens, "ignore_eos": True, "logprob_top_k": 2,
        "logprob_ranges": (PositionRange(1, n + max_tokens),),
        "readout_ranges": (PositionRange(0, n + max_tokens),),
        "steering": steering,
    }  # fmt: skip


def ids(events: list[Any]) -> list[int]:
    return [e.id for e in events]


def same(a: list[Any], b: list[Any]) -> bool:
    """Bit for bit: ids, logprobs and readouts."""
    return [(e.position, e.id, e.logprob, e.top_logprobs) for e in a] == [
        (e.position, e.id, e.logprob, e.top_logprobs) for e in b
    ] and all(np.array_equal(x.readout, y.readout) for x, y in zip(a, b, strict=True))


async def test_vllm_steers_as_the_transformers_engine_does(engines: Any) -> None:
    hf, vl = engines
    p = prompt(hf, "steer both engines alike")
    plain, _ = await run(vl, p, **spec(p))
    for steering in ((push(8.0),), MIXED):
        hf_events, _ = await run(hf, p, **spec(p, *steering))
        vl_events, _ = await run(vl, p, **spec(p, *steering))
        assert_compiled(vl)
        worst = compare(hf_events, vl_events)  # same greedy tokens; logprobs and readouts within tolerance
        print("steered worst differences:", worst)
        assert ids(vl_events) != ids(plain)  # the steering changed the answer


async def test_scale_zero_and_an_unsteered_request_are_exactly_the_unsteered_run(engines: Any) -> None:
    _, vl = engines
    p = prompt(vl, "steer me nowhere")
    plain, _ = await run(vl, p, **spec(p))
    zero, _ = await run(vl, p, **spec(p, push(0.0), push(0.0, layer=1, norm_match=True)))
    assert same(plain, zero)


async def test_steered_and_unsteered_requests_batched_are_what_they_are_alone(engines: Any) -> None:
    _, vl = engines
    texts = ["a", "a longer question about prisms", "mid length", "the longest prompt of them all"]
    ps = [prompt(vl, t) for t in texts]
    steerings: list[tuple[SteeringEntry, ...]] = [(), (push(6.0),), (), MIXED]
    alone = [await run(vl, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)]
    mixed = await asyncio.gather(*(run(vl, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)))
    unsteered = await asyncio.gather(*(run(vl, p, **spec(p)) for p in ps))
    for (a, _), (m, _) in zip(alone, mixed, strict=True):
        assert ids(a) == ids(m)  # steered or not, batched is what alone is
        for x, y in zip(a, m, strict=True):
            assert np.allclose(x.readout, y.readout, atol=1e-4)
    for row in (0, 2):  # the same batch with and without neighbours that steer: bit for bit
        assert same(mixed[row][0], unsteered[row][0])
    assert ids(mixed[1][0]) != ids(unsteered[1][0])


async def test_the_prefix_cache_serves_only_blocks_computed_under_the_same_steering(engines: Any) -> None:
    _, vl = engines
    block = vl.cache_block_size
    key = uuid.uuid4().hex
    first = prompt(vl, "a long first turn about caches and steering", 3 * block)
    short = {"max_tokens": 4, "ignore_eos": True}
    both = (push(5.0),)
    events, done = await run(vl, first, key, **short, steering=both)
    assert done.cached_tokens == 0
    timeline = first + tuple(ids(events))
    second = timeline + prompt(vl, "and a second")
    events, done = await run(vl, second, key, **short, steering=both)  # same steering: the blocks serve
    assert done.cached_tokens == len(timeline) // block * block > 0
    third = second + tuple(ids(events))
    alone, _ = await run(vl, third, None, **short)  # what the unsteered turn must compute
    events, done = await run(vl, third, key, **short)  # unsteered: nothing of the steered blocks
    assert done.cached_tokens == 0 and done.prefilled_tokens == len(third)
    assert ids(events) == ids(alone)
    events, done = await run(vl, third, key, **short)  # unsteered again: its own blocks serve
    assert done.cached_tokens == (len(third) - 1) // block * block
    # prompt and generated steered differently: only the same prompt and spec may share blocks
    later = (push(5.0, positions=Positions.GENERATED),)
    events, done = await run(vl, third, key, **short, steering=later)
    assert done.cached_tokens == 0
    fourth = third + tuple(ids(events)) + prompt(vl, "more")
    fresh, _ = await run(vl, fourth, None, **short, steering=later)
    events, done = await run(vl, fourth, key, **short, steering=later)
    assert done.cached_tokens == 0 and ids(events) == ids(fresh)


async def test_session_values_are_not_reused_across_steering(engines: Any) -> None:
    """Readouts the engine stored for a session's earlier turn are only served under the same steering."""
    _, vl = engines
    key = uuid.uuid4().hex
    p = prompt(vl, "stored readouts and steering")
    n = len(p)
    ask = {"max_tokens": 2, "ignore_eos": True, "readout_ranges": (PositionRange(0, n),)}
    plain, _ = await run(vl, p, key, **ask)
    steered, _ = await run(vl, p, key, **ask, steering=(push(8.0, positions=Positions.PROMPT),))
    fresh, _ = await run(vl, p, None, **ask, steering=(push(8.0, positions=Positions.PROMPT),))
    assert all(np.array_equal(a.readout, b.readout) for a, b in zip(steered, fresh, strict=True))
    assert not np.allclose(steered[3].readout, plain[3].readout)


def gated(threshold: float, comparison: Comparison = Comparison.ABOVE, *, layer: int = 0, **kw: Any) -> SteeringEntry:
    return push(GATE_SCALE, layer=1, gate=Gate("concept0", layer, comparison, threshold), **kw)


GATE_SCALE = 8.0
GATE_TEXT = "a prompt long enough that the gate opens at some of its positions and stays shut at others"


def moved(plain: list[Any], steered: list[Any], upto: int) -> list[int]:
    """Positions below ``upto`` whose layer-1 ``concept1`` readout moved (by about the gate's scale)."""
    out = []
    for a, s in zip(plain[:upto], steered[:upto], strict=True):
        delta = float(s.readout[1, 1] - a.readout[1, 1])
        assert delta == 0.0 or abs(delta - GATE_SCALE) < 1e-2, (a.position, delta)
        if delta:
            out.append(a.position)
    return out


def between(values: list[float]) -> float:
    """A threshold about the median, far from every value: the two engines' readouts differ by float noise."""
    v = np.sort(np.asarray(values))
    middle = range(len(v) // 3, 2 * len(v) // 3)
    k = max(middle, key=lambda i: v[i + 1] - v[i])
    return float(v[k] + v[k + 1]) / 2


async def test_vllm_gates_as_the_transformers_engine_does(engines: Any) -> None:
    hf, vl = engines
    p = prompt(vl, GATE_TEXT)
    n = len(p)
    plain, _ = await run(vl, p, **spec(p))
    for layer in (0, 1):
        values = [float(e.readout[layer, 0]) for e in plain]
        threshold = between(values[:n])
        for comparison in Comparison:
            entry = gated(threshold, comparison, layer=layer)
            hf_events, _ = await run(hf, p, **spec(p, entry))
            vl_events, _ = await run(vl, p, **spec(p, entry))
            assert_compiled(vl)
            worst = compare(hf_events, vl_events)  # same greedy tokens; logprobs and readouts within tolerance
            print(f"gated at layer {layer} {comparison.value}: worst differences {worst}")
            # over the prompt the gate readouts are the unsteered ones (a vector after layer 1 changes
            # neither layer 0 nor 1 at any prompt position): steered exactly where the previous one passes
            above = comparison is Comparison.ABOVE
            expected = [q for q in range(1, n) if (values[q - 1] > threshold if above else values[q - 1] < threshold)]
            assert 0 < len(expected) < n - 1
            assert moved(plain, vl_events, n) == expected


async def test_a_gate_that_never_opens_is_exactly_unsteered(engines: Any) -> None:
    _, vl = engines
    p = prompt(vl, GATE_TEXT)
    plain, _ = await run(vl, p, **spec(p))
    for entry in (gated(1e30), gated(-1e30, Comparison.BELOW), gated(1e30, layer=1)):
        events, _ = await run(vl, p, **spec(p, entry))
        assert same(plain, events)


async def test_a_gate_that_always_opens_is_exactly_the_ungated_entry(engines: Any) -> None:
    _, vl = engines
    p = prompt(vl, GATE_TEXT)
    entry = gated(-1e30, positions=Positions.GENERATED)  # every generated position has a previous one
    ungated, _ = await run(vl, p, **spec(p, replace(entry, gate=None)))
    plain, _ = await run(vl, p, **spec(p))
    events, _ = await run(vl, p, **spec(p, entry))
    assert same(ungated, events) and not same(plain, events)
    # over the prompt too: everything but position 0, which has no previous position
    both, _ = await run(vl, p, **spec(p, gated(1e30, Comparison.BELOW)))
    assert moved(plain, both, len(p)) == list(range(1, len(p)))


async def test_gated_requests_batched_are_what_they_are_alone(engines: Any) -> None:
    _, vl = engines
    ps = [prompt(vl, t) for t in ("a", "a longer question about prisms", "mid length", GATE_TEXT)]
    steerings: list[tuple[SteeringEntry, ...]] = [
        (gated(0.0),),
        (),
        (gated(0.0, Comparison.BELOW, layer=1), gated(0.0)),
        (gated(0.0, positions=Positions.GENERATED), push(2.0, concept="concept2")),
    ]
    alone = [await run(vl, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)]
    mixed = await asyncio.gather(*(run(vl, p, **spec(p, *s)) for p, s in zip(ps, steerings, strict=True)))
    for (a, _), (m, _) in zip(alone, mixed, strict=True):
        assert ids(a) == ids(m)
        for x, y in zip(a, m, strict=True):
            assert np.allclose(x.readout, y.readout, atol=1e-4)
    assert same(alone[1][0], mixed[1][0])  # the unsteered neighbour: bit for bit


async def test_a_gated_request_never_reads_the_prefix_cache(engines: Any) -> None:
    _, vl = engines
    key = uuid.uuid4().hex
    p = prompt(vl, "a long first turn about caches and gates", 3 * vl.cache_block_size)
    entry = gated(0.0)
    short = {"max_tokens": 4, "ignore_eos": True}
    events, done = await run(vl, p, key, **short, steering=(entry,))
    second = p + tuple(ids(events)) + prompt(vl, "and a second")
    fresh, _ = await run(vl, second, None, **short, steering=(entry,))
    events, done = await run(vl, second, key, **short, steering=(entry,))
    assert done.cached_tokens == 0 and done.prefilled_tokens == len(second)
    assert ids(events) == ids(fresh)
    assert steer.cache_salt(None, (entry,), len(p)) != steer.cache_salt(None, (replace(entry, gate=None),), len(p))


def test_the_compiled_op_gates_on_the_previous_row_and_on_the_value_carried_between_steps() -> None:
    """One request's prompt in two steps under torch.compile: the second step's first row takes the carried value."""
    torch.manual_seed(0)
    hidden, concepts, rows = 16, 3, 64
    model = _Model(hidden, 3).eval()
    directions = [np.random.default_rng(i).standard_normal((concepts, hidden)).astype(np.float32) for i in (1, 2)]
    chunks = [torch.randn(5, hidden), torch.randn(5, hidden)]
    readouts, buffers = capture.install(model, directions, [0, 2], rows, steering_rounds=steer.MAX_ROUNDS)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    writer = SteerWriter(buffers)

    def steps(gate: list[Any] | None) -> list[torch.Tensor]:
        entry = [1, 1 + 2, 4.0, 0, "both", gate]  # concept 2 at pack layer 2, over every position
        out = []
        for i, x in enumerate(chunks):
            request = SteeredRows("a", 0, 5, 5 * i, {"n": 10, "e": [entry], "raw": []})
            writer.plan([request], 5)
            out.append(compiled(x))
            writer.carry([request])
        return out

    with torch.no_grad():
        plain, values = [], []
        for x in chunks:
            writer.plan([], 5)
            plain.append(compiled(x))
            values.append(readouts[0][:5, 1].clone())  # layer 0's concept 1: nothing steers there
        v = torch.cat(values)
        threshold = float(v.median())
        ungated = torch.cat(steps(None))
        gated = torch.cat(steps([0, 1, 1, threshold]))  # open where layer 0's concept 1 was above it
        after = torch.cat(steps(None))  # the steps after forget the gates (a CUDA graph would read them)
    assert torch.equal(after, ungated) and all(bool((b.gate == -1).all()) for b in buffers)
    whole = torch.cat(plain)
    opened = [q for q in range(10) if q > 0 and float(v[q - 1]) > threshold]
    assert 5 in opened or float(v[4]) <= threshold  # position 5 is decided by the value carried from step 1
    assert 0 < len(opened) < 9
    for q in range(10):
        assert torch.equal(gated[q], ungated[q] if q in opened else whole[q]), q


def test_a_vector_of_scale_zero_leaves_the_bf16_stream_unwritten() -> None:
    """hidden and residual come out of a layer as they went in, not re-rounded as hidden + residual."""
    torch.manual_seed(0)
    hidden, concepts, rows = 16, 3, 64
    model = _Model(hidden, 2).eval().to(torch.bfloat16)
    directions = [np.random.default_rng(1).standard_normal((concepts, hidden)).astype(np.float32)]
    _, buffers = capture.install(model, directions, [0], rows, steering_rounds=steer.MAX_ROUNDS)
    writer = SteerWriter(buffers)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.model.layers[0].register_forward_hook(lambda _m, _a, out: seen.append((out[0].clone(), out[1].clone())))
    x = torch.randn(5, hidden).to(torch.bfloat16)
    with torch.no_grad():
        writer.plan([], 5)
        model(x)
        for scale in (0.0, 4.0):
            request = SteeredRows(f"scale {scale}", 0, 5, 0, {"n": 5, "e": [[0, 1, scale, 0, "both", None]], "raw": []})
            writer.plan([request], 5)
            model(x)
    (plain_h, plain_r), (zero_h, zero_r), (steered_h, steered_r) = seen
    assert torch.equal(zero_h, plain_h) and torch.equal(zero_r, plain_r)
    assert not torch.equal(steered_h, plain_h) and bool((steered_r == 0).all())  # a real vector does write


async def test_steering_rounds_bound_the_vectors_at_one_layer(
    engines: Any, tiny_model_dir: Path, tiny_pack: Path
) -> None:
    """``vllm_steering_rounds = 1``: one vector per layer steers as the full engine does; two are refused."""
    _, full = engines
    one = make_vllm_engine(tiny_model_dir, concept_pack=tiny_pack, steering_rounds=1)
    await one.start()
    try:
        p = prompt(one, "Tell me about the sea.")
        per_layer = (push(6.0), push(0.5, layer=1, concept="concept2", norm_match=True))
        mine, _ = await run(one, p, **spec(p, *per_layer))
        theirs, _ = await run(full, p, **spec(p, *per_layer))
        plain, _ = await run(one, p, **spec(p))
        assert_compiled(one)
        assert same(mine, theirs) and ids(mine) != ids(plain)
        with pytest.raises(GatewayError) as caught:
            await run(one, p, **spec(p, push(6.0), push(2.0)))
        assert caught.value.code is Code.INVALID_ARGUMENT and "vllm_steering_rounds" in caught.value.message
        again, _ = await run(one, p, **spec(p, *per_layer))  # the refusal left nothing behind
        assert same(again, mine)
    finally:
        await one.close()


def test_steering_rounds_zero_leaves_steering_out(tiny_model_dir: Path, tiny_pack: Path) -> None:
    """0: no steering buffers in the graph, and a steering request is refused naming the setting."""
    from transformers import AutoTokenizer

    from prismgate.core.checks import check_steering
    from prismgate.engines.readouts.pack import ConceptPack
    from prismgate.engines.vllm import config

    model = _Model(16, 3).eval()
    directions = [np.zeros((3, 16), dtype=np.float32)] * 2
    assert capture.install(model, directions, [0, 2], 8, steering_rounds=0)[1] == []
    pack = ConceptPack.load(tiny_pack)
    options = config.Options(tiny_model_dir, "tiny-llama", concept_pack=tiny_pack, steering_rounds=0)
    info = config.engine_info(options, AutoTokenizer.from_pretrained(str(tiny_model_dir)), 513, pack.manifest)
    assert info.readouts is not None and not info.steering
    with pytest.raises(GatewayError) as caught:
        check_steering(info, (push(1.0),))
    assert caught.value.code is Code.INVALID_ARGUMENT
    assert "turned off" in caught.value.message and "vllm_steering_rounds = 0" in caught.value.message
    with pytest.raises(GatewayError, match="vllm_steering_rounds must be in"):
        make_vllm_engine(tiny_model_dir, concept_pack=tiny_pack, steering_rounds=9)


def test_what_a_cuda_graph_records_computes_what_the_host_path_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's recorded form (every round, gate and norm, whatever the host says) against its lean form.

    Under CUDA-graph capture the op ignores the host's round counts and records everything;
    unused rounds must select nothing. Forcing that form here, on the CPU, checks its
    arithmetic bit for bit on a batch with stacked, norm-matched, gated and unsteered rows.
    """
    torch.manual_seed(0)
    hidden, concepts, rows = 16, 3, 64
    model = _Model(hidden, 3).eval()
    directions = [np.random.default_rng(i).standard_normal((concepts, hidden)).astype(np.float32) for i in (1, 2)]
    x = torch.randn(12, hidden)
    _, buffers = capture.install(model, directions, [0, 2], rows, steering_rounds=3)
    writer = SteerWriter(buffers)
    stacked = [[0, 2, 3.0, 0, "both", None], [0, 3, 0.5, 1, "generated", None], [1, 1, -2.0, 0, "prompt", None]]
    gated = [[1, 1 + 2, 4.0, 0, "both", [0, 1, 1, 0.0]]]
    requests = [
        SteeredRows("a", 0, 4, 0, {"n": 2, "e": stacked, "raw": []}),  # rows 4-7: nobody's
        SteeredRows("g", 8, 4, 0, {"n": 4, "e": gated, "raw": []}),
    ]

    def run_once() -> torch.Tensor:
        writer.plan(requests, 12)
        with torch.no_grad():
            out = model(x)
        writer.plan([], 12)
        return out

    lean = run_once()
    monkeypatch.setattr(capture, "recording", lambda hidden: True)
    recorded = run_once()
    with torch.no_grad():
        idle = model(x)  # recorded with nobody steering: every round selects nothing
    monkeypatch.undo()
    with torch.no_grad():
        plain = model(x)
    assert torch.equal(recorded, lean)
    assert torch.equal(idle, plain)
    assert not torch.equal(lean[:4], plain[:4]) and torch.equal(lean[4:8], plain[4:8])


@pytest.mark.slow
async def test_smollm2_steered_toward_french_agrees_with_transformers() -> None:
    require_vllm()
    from prismgate.engines.models import DEFAULT_MODEL_ID, default_model_path
    from prismgate.engines.readouts.pack import DEFAULT_PACKS

    pack = DEFAULT_PACKS / "smollm2-135m-instruct.safetensors"
    hf, vl = await pair(default_model_path(), pack, DEFAULT_MODEL_ID)
    try:
        chat = [{"role": "user", "content": "Tell me about your favourite food."}]
        p = tuple(hf.info.tokenizer.render_chat(chat))
        n = len(p)
        ask: dict[str, Any] = {
            "max_tokens": 20,
            "logprob_ranges": (PositionRange(n - 8, n + 20),),
            "logprob_top_k": 3,
            "readout_ranges": (PositionRange(1, n + 20),),
        }
        plain, _ = await run(vl, p, **ask)
        french = (
            SteeringEntry(layer=12, scale=24.0, concept="french"),
            SteeringEntry(layer=16, scale=0.1, concept="french", norm_match=True, positions=Positions.GENERATED),
        )
        hf_events, _ = await run(hf, p, **ask, steering=french)
        vl_events, _ = await run(vl, p, **ask, steering=french)
        assert_compiled(vl)
        worst = compare(hf_events, vl_events)
        text = vl.info.tokenizer.decode(ids([e for e in vl_events if not e.is_prefill]))
        print("SmolLM2 steered worst differences:", worst, "answer:", text)
        assert ids(vl_events) != ids(plain)
    finally:
        await vl.close()
        await hf.close()
