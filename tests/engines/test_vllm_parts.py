"""The vLLM engine's parts that need no vLLM: side-channel framing, the session value store,
image-run collapsing, image token counts, the in-graph readout op under torch.compile, and
the engine arguments (compilation, worker classes, memory). These run in every environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prismgate.core.engine import VisionTokens
from prismgate.core.errors import Code, GatewayError
from prismgate.core.session import ImageSpan
from prismgate.core.steering import Positions, SteeredSpan, SteeringEntry, spans
from prismgate.engines.vllm import capture, config
from prismgate.engines.vllm.channel import LogprobRows, Sender, StepPacket, decode_step, encode_step
from prismgate.engines.vllm.events import decode_logprob
from prismgate.engines.vllm.plan import ranges
from prismgate.engines.vllm.steer import MAX_ROUNDS, RAW_SLOTS, RawSlots, cache_salt
from prismgate.engines.vllm.steer_rows import SteeredRows, SteerWriter
from prismgate.engines.vllm.store import SessionValues, ValueStore
from prismgate.engines.vllm.vision import ImageCounter, collapse
from tests.vision_model import IMAGE_PAD, VISION_END, VISION_START, build_tiny_qwen2_vl, image_bytes, vision_block

pytestmark = pytest.mark.engine_suite


async def test_side_channel_delivers_over_its_socket_and_its_sender_never_preempts_the_step() -> None:
    """A worker's packets reach the gateway's receiver over the real socket, in order; and the
    sender's I/O thread (the one a send wakes) is a batch thread, which the kernel does not let
    preempt the engine step that woke it."""
    import asyncio
    import os

    pytest.importorskip("zmq", reason="the side channel's ZMQ comes with vLLM (the vLLM tier runs this)")
    from prismgate.engines.vllm.tracker import Receiver

    def threads() -> dict[int, int]:  # ZMQ's threads (it names them ZMQbg/...) -> scheduling policy (stat field 41)
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            if stat.split("(", 1)[1].startswith("ZMQbg"):
                out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[38])
        return out

    receiver = Receiver(n_layers=2)
    receiver.start()
    tracker = receiver.open("pg1")
    before = {int(tid) for tid in os.listdir("/proc/self/task")}  # every thread, named yet or not (the receiver's)
    sender = Sender(receiver.address)
    try:
        # each of ZMQ's threads names itself and sets its policy as it starts: on a loaded machine, a while later
        for _ in range(500):
            new = {tid: policy for tid, policy in threads().items() if tid not in before}
            if new and set(new.values()) == {os.SCHED_BATCH}:
                break
            await asyncio.sleep(0.01)
        assert new and set(new.values()) == {os.SCHED_BATCH}, new
        for step in range(3):
            packet = StepPacket(step=step)
            packet.add("pg1", np.array([10 + step]), np.full((1, 2, 3), step, dtype=np.float32))
            sender.send(encode_step(packet))
        for _ in range(200):
            if receiver.steps == 3:
                break
            await asyncio.sleep(0.01)
        assert receiver.steps == 3 and receiver.rows_seen["pg1"] == 3
        assert tracker is not None
    finally:
        sender.close()
        await receiver.close()


def test_step_packets_round_trip() -> None:
    packet = StepPacket(step=7)
    ro = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
    packet.add("pg1", np.array([10, 11, 12, 13]), ro, LogprobRows.of([(11, -1.5, [3, 4], [-0.5, -1.0])], k=2))
    packet.add("pg2", np.array([99]), None)
    back = decode_step(encode_step(packet))
    assert back.step == 7 and [r.key for r in back.requests] == ["pg1", "pg2"]
    assert back.requests[0].positions.tolist() == [10, 11, 12, 13]
    assert back.requests[0].readouts is not None and np.array_equal(back.requests[0].readouts, ro)
    assert back.requests[0].logprobs is not None
    assert back.requests[0].logprobs.rows() == [(11, -1.5, [3, 4], [-0.5, -1.0])]
    assert back.requests[1].readouts is None and back.requests[1].positions.tolist() == [99]
    assert back.requests[1].logprobs is None


def test_a_step_scores_the_prompt_positions_its_ranges_cover_and_no_others() -> None:
    """The worker picks the rows to score with array arithmetic; the per-position rule it replaced is
    the reference: row ``i`` scores target ``positions[i] + 1`` when that is a prompt position in a range."""
    from prismgate.engines.vllm.worker import _RequestPlan

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 1000, size=300).tolist()
    for _ in range(50):
        start, n = int(rng.integers(0, 320)), int(rng.integers(1, 40))
        ranges = [sorted(int(x) for x in rng.integers(0, 330, size=2)) for _ in range(int(rng.integers(1, 4)))]
        lo = int(rng.integers(0, 9))
        positions = start + np.arange(n, dtype=np.int64)
        plan = _RequestPlan("pg1", lo, lo + n, positions, {"lp": ranges, "k": 2}, prompt)
        want = [
            (lo + i, p + 1, prompt[p + 1])
            for i, p in enumerate(positions.tolist())
            if p + 1 < len(prompt) and any(a <= p + 1 < b for a, b in ranges)
        ]
        got = plan.logprob_rows()
        assert (got is None and not want) or (
            got is not None and list(zip(*(a.tolist() for a in got), strict=True)) == want
        ), (start, n, ranges)
    assert _RequestPlan("pg1", 0, 3, np.arange(3), {"k": 2}, prompt).logprob_rows() is None  # nothing asked


def test_prompt_logprob_frames_of_another_size_are_refused() -> None:
    packet = StepPacket(step=2)
    packet.add("pg1", np.array([1, 2]), None, LogprobRows.of([(2, -0.5, [4], [-0.5]), (3, -1.0, [9], [-0.25])], k=1))
    frames = encode_step(packet)
    assert decode_step(frames).requests[0].logprobs is not None
    short = [*frames]
    short[1 + 7] = short[1 + 7][:-4]  # the top ids of one row fewer
    with pytest.raises(ValueError, match="top logprob ids"):
        decode_step(short)


def test_a_truncated_packet_is_refused() -> None:
    packet = StepPacket(step=1)
    packet.add("pg1", np.array([1, 2]), np.zeros((2, 1, 1), np.float32))
    frames = encode_step(packet)
    with pytest.raises(ValueError):
        decode_step(frames[:-1])


def plain(n: int) -> tuple[SteeredSpan, ...]:
    """The steering record of ``n`` unsteered positions."""
    return spans((), n, n)


def test_store_keeps_only_what_the_new_timeline_still_shares() -> None:
    store = ValueStore(max_positions=100)
    ro = {p: np.full((1, 1), p, np.float32) for p in range(6)}
    lp = {3: (2, -0.5, [(7, -0.1), (8, -0.2)])}
    store.put("s", SessionValues([1, 2, 3, 4, 5, 6], ro, lp, computed=6, steered=plain(6)))
    same = store.lookup("s", [1, 2, 3, 4, 5, 6, 7], plain(7))
    assert sorted(same.readouts) == list(range(6)) and same.computed == 6
    assert same.logprob(3, 1) == (1, -0.5, [(7, -0.1)])
    assert same.logprob(3, 5) is None  # computed with top-2 only
    rewound = store.lookup("s", [1, 2, 3, 9, 9], plain(5))
    assert sorted(rewound.readouts) == [0, 1, 2] and rewound.logprobs == {} and rewound.computed == 3
    store.release("s")
    assert store.lookup("s", [1, 2, 3], plain(3)).readouts == {}


def test_store_keeps_only_values_computed_under_the_steering_the_new_request_applies() -> None:
    store = ValueStore(max_positions=100)
    ro = {p: np.full((1, 1), p, np.float32) for p in range(6)}
    push = (SteeringEntry(layer=0, scale=2.0, concept="c", positions=Positions.GENERATED),)
    store.put("s", SessionValues([1, 2, 3, 4, 5, 6], ro, {}, computed=6, steered=spans(push, 4, 6)))
    assert sorted(store.lookup("s", [1, 2, 3, 4, 5, 6, 7], plain(7)).readouts) == [0, 1, 2, 3]
    assert store.lookup("s", [1, 2, 3, 4, 5, 6, 7], spans(push, 7, 7)).readouts.keys() == set(range(4))
    both = (SteeringEntry(layer=0, scale=2.0, concept="c"),)
    assert store.lookup("s", [1, 2, 3, 4, 5, 6, 7], spans(both, 7, 7)).readouts == {}


def test_store_evicts_least_recently_used_sessions() -> None:
    store = ValueStore(max_positions=10)
    for key in "abc":
        store.put(key, SessionValues([1] * 4, {p: np.zeros((1, 1), np.float32) for p in range(4)}, steered=plain(4)))
    assert len(store) == 2 and store.lookup("a", [1] * 4, plain(4)).readouts == {}


def test_ranges_and_vllm_logprob_dicts() -> None:
    assert ranges([5, 1, 2, 3, 7]) == [[1, 4], [5, 6], [7, 8]]

    class Lp:
        def __init__(self, logprob: float, rank: int) -> None:
            self.logprob, self.rank = logprob, rank

    entry = {9: Lp(-3.0, 4), 1: Lp(-0.5, 1), 2: Lp(-1.0, 2)}
    assert decode_logprob(entry, 9, 2) == (-3.0, [(1, -0.5), (2, -1.0)])
    assert decode_logprob(entry, 9, 0) == (-3.0, None)
    tied = {7: Lp(-0.5, 1), 3: Lp(-0.5, 1), 5: Lp(-2.0, 3)}  # vLLM ranks equals alike: the lowest id goes first
    assert decode_logprob(tied, 7, 3) == (-0.5, [(3, -0.5), (7, -0.5), (5, -2.0)])


VISION = VisionTokens(vision_start=VISION_START, image_pad=IMAGE_PAD, vision_end=VISION_END)


def test_image_runs_collapse_to_one_pad() -> None:
    tokens = [1, 2, *vision_block(4), 3, *vision_block(6), 4]
    images = [ImageSpan.of(2, 8, b"a", "image/png"), ImageSpan.of(9, 17, b"b", "image/png")]
    assert collapse(tokens, images, VISION) == [1, 2, *vision_block(1), 3, *vision_block(1), 4]
    assert collapse([1, 2], [], None) == [1, 2]
    with pytest.raises(GatewayError):
        collapse(tokens, images, None)


@pytest.mark.parametrize(("width", "height"), [(56, 56), (100, 60), (300, 200)])
def test_image_token_count_comes_from_the_models_processor(tmp_path: Path, width: int, height: int) -> None:
    from transformers import Qwen2VLImageProcessorPil

    model = build_tiny_qwen2_vl(tmp_path / "vl")
    data = image_bytes(width, height)
    processor = Qwen2VLImageProcessorPil.from_pretrained(model)
    grid = processor(images=[_pil(data)], return_tensors="np")["image_grid_thw"][0]
    expected = int(np.prod(grid)) // processor.merge_size**2
    assert ImageCounter(model)(data, "image/png") == expected
    assert 4 <= expected <= 16


def _pil(data: bytes) -> object:
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


class _Layer(torch.nn.Module):
    """Stands for a vLLM decoder layer: returns ``(hidden_states, residual)``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(hidden), hidden + residual


class _Model(torch.nn.Module):
    def __init__(self, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(_Layer(hidden) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for layer in self.model.layers:
            x, residual = layer(x, residual)
        return x + residual


def test_in_graph_readouts_fill_their_buffers_under_torch_compile() -> None:
    torch.manual_seed(0)
    hidden, concepts, rows = 16, 3, 64
    model = _Model(hidden, 3).eval()
    directions = [np.random.default_rng(i).standard_normal((concepts, hidden)).astype(np.float32) for i in (1, 2)]
    expected: dict[int, torch.Tensor] = {}

    def reference(x: torch.Tensor) -> None:  # the residual stream after layers 0 and 2, read by plain hooks
        handles = [
            model.model.layers[i].register_forward_hook(
                lambda _m, _a, out, i=i, d=d: expected.__setitem__(i, (out[0] + out[1]) @ torch.from_numpy(d).T)
            )
            for i, d in zip((0, 2), directions, strict=True)
        ]
        with torch.no_grad():
            model(x)
        for h in handles:
            h.remove()

    inputs = [torch.randn(n, hidden) for n in (5, 11, 2)]
    wanted = []
    for x in inputs:
        reference(x)
        wanted.append([expected[0].clone(), expected[2].clone()])
    buffers, _ = capture.install(model, directions, [0, 2], rows)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for x, want in zip(inputs, wanted, strict=True):  # several batch sizes through one traced graph
        with torch.no_grad():
            compiled(x)
        n = x.shape[0]
        for buf, w in zip(buffers, want, strict=True):
            assert buf.shape == (rows, concepts)
            torch.testing.assert_close(buf[:n], w, rtol=1e-5, atol=1e-5)


def test_the_readout_op_skips_its_work_in_steps_nobody_reads() -> None:
    """The host flag under torch.compile: 0 leaves the buffers as they were, 1 writes this step's readouts."""
    torch.manual_seed(0)
    hidden, concepts, rows = 16, 4, 32
    model = _Model(hidden, 3).eval()
    directions = [np.random.default_rng(i).standard_normal((concepts, hidden)).astype(np.float32) for i in (1, 2)]
    wanted = torch.ones(1, dtype=torch.int64)
    buffers, _ = capture.install(model, directions, [0, 2], rows, wanted=wanted)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    first, second = torch.randn(6, hidden), torch.randn(6, hidden)
    with torch.no_grad():
        compiled(first)
        read = [b.clone() for b in buffers]
        wanted[0] = 0
        compiled(second)
        assert all(torch.equal(b, r) for b, r in zip(buffers, read, strict=True))  # nothing written
        wanted[0] = 1
        compiled(second)
    assert not any(torch.equal(b[:6], r[:6]) for b, r in zip(buffers, read, strict=True))  # the second input's


def _steer_rows(key: str, lo: int, positions: range, prompt_len: int, *entries: list[Any]) -> SteeredRows:
    steering = {"n": prompt_len, "e": [[*e, None] for e in entries], "raw": []}  # ungated
    return SteeredRows(key, lo, len(positions), positions.start, steering)


def test_in_graph_steering_adds_to_the_rows_the_host_planned_under_torch_compile() -> None:
    """The op in a compiled graph: steered rows get the vectors in order, every other row stays bit for bit."""
    torch.manual_seed(0)
    hidden, concepts, rows = 16, 3, 64
    model = _Model(hidden, 3).eval()
    directions = [np.random.default_rng(i).standard_normal((concepts, hidden)).astype(np.float32) for i in (1, 2)]
    x = torch.randn(7, hidden)
    with torch.no_grad():
        plain = model(x)
    _, steer = capture.install(model, directions, [0, 2], rows, steering_rounds=MAX_ROUNDS)
    writer = SteerWriter(steer)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        writer.plan([], 7)
        assert torch.equal(compiled(x), plain)  # nobody steers: the op returns before touching anything
        # rows 0-3: positions 0..3 of a request with a 2-token prompt; rows 4-6 nobody's
        entries = [0, 2, 3.0, 0, "both"], [0, 3, 0.5, 1, "generated"], [1, 1, -2.0, 0, "prompt"]
        request = _steer_rows("a", 0, range(4), 2, *entries)
        writer.plan([request], 7)
        out = compiled(x)
        writer.plan([], 7)
        again = compiled(x)
    assert torch.equal(out[4:], plain[4:]) and not torch.equal(out[:4], plain[:4])
    assert torch.equal(again, plain)  # the step after forgets the plan: stale rows are cleared
    units = [capture.unit_directions(d, "cpu") for d in directions]

    def reference(x: torch.Tensor) -> torch.Tensor:  # the op's arithmetic, written out, on the eager model
        h, residual = x, torch.zeros_like(x)
        for i, layer in enumerate(model.model.layers):
            h, residual = layer.__class__.forward(layer, h, residual)
            if i == 0:
                stream = (h + residual)[:4]
                f = stream.clone()
                f = f + 3.0 * units[0][1]  # concept 1 everywhere
                f[2:] = f[2:] + 0.5 * units[0][2] * f[2:].norm(dim=-1, keepdim=True)  # generated rows only
                h, residual = h.clone(), residual.clone()
                h[:4], residual[:4] = f, 0.0
            if i == 2:
                f = (h + residual)[:2] - 2.0 * units[1][0]  # prompt rows only
                h, residual = h.clone(), residual.clone()
                h[:2], residual[:2] = f, 0.0
        return h + residual

    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-5)


def test_raw_steering_directions_in_flight_are_bounded_per_layer() -> None:
    slots = RawSlots(2)
    taken = {slots.take("a", 0) for _ in range(RAW_SLOTS)}
    assert taken == set(range(RAW_SLOTS))
    assert slots.take("b", 1) == 0  # another layer's rows are its own
    with pytest.raises(GatewayError) as caught:
        slots.take("b", 0)
    assert caught.value.code is Code.RESOURCE_EXHAUSTED
    slots.release("a")
    assert slots.take("c", 0) in taken


def test_the_cache_salt_names_the_steering_of_prompt_and_generated_positions() -> None:
    both = (SteeringEntry(layer=0, scale=2.0, concept="c"),)
    later = (SteeringEntry(layer=0, scale=2.0, concept="c", positions=Positions.GENERATED),)
    assert cache_salt("s", (), 10) == "s" and cache_salt(None, (), 10) is None  # unsteered: as ever
    assert cache_salt("s", both, 10) == cache_salt("s", both, 40) not in {"s", cache_salt("t", both, 10)}
    assert cache_salt("s", later, 10) != cache_salt("s", later, 11)  # prompt and generated differ: per prompt
    assert cache_salt("s", later, 10) != cache_salt("s", both, 10)


def test_engine_args_run_vllm_compiled_with_prismgate_workers(tiny_model_dir: Path, tiny_pack: Path) -> None:
    options = config.Options(model_path=tiny_model_dir, model_id="tiny", concept_pack=tiny_pack, kv_cache_gb=1)
    args = config.engine_args(options, on_cpu=True)
    assert args["enforce_eager"] is False
    assert args["worker_cls"] == config.CPU_WORKER
    assert config.engine_args(options, on_cpu=False)["worker_cls"] == config.GPU_WORKER
    settings = args["additional_config"]["prismgate"]  # read by the worker; part of vLLM's compile-cache key
    assert settings["pack"] == str(tiny_pack) and len(settings["digest"]) == 16
    eager = config.Options(model_path=tiny_model_dir, model_id="tiny", enforce_eager=True, kv_cache_gb=1)
    assert config.engine_args(eager, on_cpu=True)["enforce_eager"] is True
    assert "additional_config" not in config.engine_args(eager, on_cpu=True)


def test_a_kv_cache_size_applies_on_cpu_and_gpu(tiny_model_dir: Path) -> None:
    options = config.Options(model_path=tiny_model_dir, model_id="tiny", kv_cache_gb=1.5, gpu_memory_utilization=0.5)
    for on_cpu in (True, False):
        memory = config.memory_args(options, on_cpu=on_cpu)
        assert memory == {"kv_cache_memory_bytes": 3 << 29, "gpu_memory_utilization": 0.5}
    gpu = config.Options(model_path=tiny_model_dir, model_id="tiny", gpu_memory_utilization=0.7)
    assert config.memory_args(gpu, on_cpu=False) == {"gpu_memory_utilization": 0.7}
    with pytest.raises(GatewayError, match="must lie in"):
        config.memory_args(
            config.Options(model_path=tiny_model_dir, model_id="t", gpu_memory_utilization=0), on_cpu=True
        )
    with pytest.raises(GatewayError, match="must be positive"):
        config.memory_args(config.Options(model_path=tiny_model_dir, model_id="t", kv_cache_gb=0), on_cpu=True)


def test_cpu_kv_cache_is_a_share_of_free_memory(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    weights = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    options = config.Options(model_path=tiny_model_dir, model_id="tiny", gpu_memory_utilization=0.5)
    assert config.cpu_kv_cache_bytes(options, 2 * gib) == gib - weights  # half of what is free, less the weights
    assert config.cpu_kv_cache_bytes(options, 100 * gib) == config.CPU_KV_CAP_BYTES
    fp32 = config.Options(model_path=tiny_model_dir, model_id="tiny", gpu_memory_utilization=0.5, dtype="float32")
    assert config.cpu_kv_cache_bytes(fp32, 2 * gib) == gib - 2 * weights
    with pytest.raises(GatewayError, match=r"only 0\.1 GiB of memory is free") as err:
        config.cpu_kv_cache_bytes(options, gib // 10)
    assert err.value.code is Code.RESOURCE_EXHAUSTED
    monkeypatch.delenv(config.CPU_KV_ENV, raising=False)
    kv = config.memory_args(options, on_cpu=True)["kv_cache_memory_bytes"]  # what is free on this machine now
    assert config.CPU_KV_MIN_BYTES <= kv <= config.CPU_KV_CAP_BYTES
    monkeypatch.setenv(config.CPU_KV_ENV, "2")  # vLLM's own knob, set by hand, still wins
    assert config.memory_args(options, on_cpu=True) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_readout_op_gives_a_row_the_same_bits_in_a_batch_of_any_size(dtype: torch.dtype) -> None:
    """The same row alone and at every slot of batches of 1 to 16 rows: the same readout bits."""
    torch.manual_seed(0)
    hidden_size, concepts = 576, 8
    directions = torch.randn(hidden_size, concepts)
    row, residual_row = torch.randn(hidden_size).to(dtype), torch.randn(hidden_size).to(dtype)
    wanted = torch.ones((), dtype=torch.int64)
    alone = torch.zeros(32, concepts)
    capture.readout(row[None], residual_row[None], directions, alone, wanted)
    for size in range(1, 17):
        for slot in {0, size // 2, size - 1}:
            hidden, residual = torch.randn(size, hidden_size).to(dtype), torch.randn(size, hidden_size).to(dtype)
            hidden[slot], residual[slot] = row, residual_row
            out = torch.zeros(32, concepts)
            capture.readout(hidden, residual, directions, out, wanted)
            assert torch.equal(out[slot], alone[0]), (size, slot)


def test_the_engine_says_what_each_worker_moved_into_huge_pages() -> None:
    one = {"huge_page_bytes": 700 << 20, "huge_pages_reason": "700 MiB of weights and other loaded memory moved"}
    assert config.huge_pages_reason([one]) == one["huge_pages_reason"]
    other = {"huge_page_bytes": 0, "huge_pages_reason": "nothing to collapse: 700 MiB already in huge pages"}
    assert config.huge_pages_reason([one, other]) == (
        "worker 0: 700 MiB of weights and other loaded memory moved; "
        "worker 1: nothing to collapse: 700 MiB already in huge pages"
    )
    assert config.huge_pages_reason([]) == ""
