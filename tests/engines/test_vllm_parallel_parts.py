"""The parallelism parts that need no vLLM: the settings, vLLM's arguments, and merging the
readouts that pipeline stages send separately. These run in every environment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from prismgate.engines.vllm import config
from prismgate.engines.vllm.channel import LogprobRows, StepPacket, decode_step, encode_step
from prismgate.engines.vllm.tracker import Tracker
from prismgate.settings import ConfigError, Settings

pytestmark = pytest.mark.engine_suite


def test_a_stage_packet_names_the_pack_layers_its_readouts_hold() -> None:
    packet = StepPacket(step=3, layers=[1])
    packet.add("pg1", np.array([5, 6]), np.ones((2, 1, 4), np.float32))
    back = decode_step(encode_step(packet))
    assert back.layers == [1] and back.requests[0].readouts is not None
    assert decode_step(encode_step(StepPacket(step=1))).layers is None  # a worker that computes every layer
    wrong = StepPacket(step=3, layers=[0, 1])
    wrong.add("pg1", np.array([5]), np.ones((1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="layers"):
        decode_step(encode_step(wrong))


def test_a_readout_arrives_once_every_stage_has_sent_its_layers() -> None:
    tracker = Tracker("pg1", n_layers=3)
    first = np.arange(2 * 2 * 4, dtype=np.float32).reshape(2, 2, 4)  # stage 0: pack layers 0 and 1
    last = -np.arange(2 * 1 * 4, dtype=np.float32).reshape(2, 1, 4)  # stage 1: pack layer 2, and the logprobs
    tracker.feed(np.array([7, 8]), first, None, layers=[0, 1])
    assert tracker.readouts == {} and tracker.computed == {7, 8}
    tracker.feed(np.array([7, 8]), last, LogprobRows.of([(8, -0.25, [], [])]), layers=[2])
    for i, p in enumerate((7, 8)):
        assert np.array_equal(tracker.readouts[p], np.concatenate([first[i], last[i]]))
    assert tracker.logprobs[8][1] == -0.25
    whole = Tracker("pg2", n_layers=3)
    whole.feed(np.array([1]), np.zeros((1, 3, 4), np.float32), None, layers=None)
    assert whole.readouts[1].shape == (3, 4)


def test_parallel_sizes_and_the_executor_backend_reach_vllm(tiny_model_dir: Path) -> None:
    options = config.Options(
        model_path=tiny_model_dir,
        model_id="tiny",
        kv_cache_gb=1,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        data_parallel_size=3,
        distributed_executor_backend="ray",
    )
    args = config.engine_args(options, on_cpu=False)
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"], args["data_parallel_size"]) == (2, 2, 3)
    assert args["distributed_executor_backend"] == "ray"
    plain = config.Options(model_path=tiny_model_dir, model_id="tiny", kv_cache_gb=1)
    assert "distributed_executor_backend" not in config.engine_args(plain, on_cpu=True)  # vLLM's own choice


def test_parallel_settings_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[[models]]\nname = "big"\nmodel = "/models/big"\nengine = "vllm"\n'
        'pipeline_parallel_size = 2\ndata_parallel_size = 4\ndistributed_executor_backend = "ray"\n'
    )
    (big,) = Settings.load({}, env={}, config_file=str(path)).served()
    assert (big.vllm.pipeline_parallel_size, big.vllm.data_parallel_size, big.vllm.distributed_executor_backend) == (
        2,
        4,
        "ray",
    )
    env = {"PRISMGATE_ENGINE": "vllm", "PRISMGATE_DATA_PARALLEL_SIZE": "2"}
    assert Settings.load({}, env=env).vllm.data_parallel_size == 2
    with pytest.raises(ConfigError, match=r"data_parallel_size .*must be 1 unless the engine is vllm"):
        Settings.load({"data_parallel_size": 2}, env={})  # the transformers engine: use replicas
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size .*0 is not valid: expected int >= 1"):
        Settings.load({"engine": "vllm", "pipeline_parallel_size": 0}, env={})
    with pytest.raises(ConfigError, match=r"distributed_executor_backend .*'slurm' is not one of mp, ray"):
        Settings.load({"engine": "vllm", "distributed_executor_backend": "slurm"}, env={})
    remote = Settings.load({"engine": "vllm", "vllm_readout_address": "tcp://10.0.0.5:5601"}, env={})
    assert remote.vllm.readout_address == "tcp://10.0.0.5:5601"
    for bad in ("ipc:///tmp/x", "tcp://10.0.0.5", "tcp://host:port", "tcp://a b:1"):
        with pytest.raises(ConfigError, match=r"vllm_readout_address .*must be tcp://HOST:PORT"):
            Settings.load({"engine": "vllm", "vllm_readout_address": bad}, env={})


def test_the_parallel_example_in_the_scaling_guide_loads(tmp_path: Path) -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    example = guide.split("## 6. vLLM's own parallelism", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "big.toml"
    path.write_text(example)
    (big,) = Settings.load({}, env={}, config_file=str(path)).served()
    names = ("engine", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    assert tuple(big.value(name) for name in names) == (
        "vllm", 4, 2, 2,
    )  # fmt: skip
