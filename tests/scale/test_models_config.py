"""``[[models]]`` in the TOML file: parsed into one engine's settings per model, mistakes named."""

from __future__ import annotations

from pathlib import Path

import pytest

from prismgate.settings import ConfigError, Settings


def load(tmp_path: Path, text: str, **overrides: object) -> Settings:
    path = tmp_path / "prismgate.toml"
    path.write_text(text)
    return Settings.load(overrides, env={}, config_file=str(path))


def test_each_model_gets_its_own_engine_settings(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        """
dtype = "bfloat16"
threads = 2
[[models]]
name = "chat"
[[models]]
name = "vision"
model = "/models/qwen2-vl"
engine = "vllm"
concept-pack = "none"
dtype = "float32"
tensor_parallel_size = 2
""",
    )
    chat, vision = settings.served()
    assert tuple(chat.value(name) for name in ("model", "model_name", "engine", "dtype", "threads")) == (
        None, "chat", "transformers", "bfloat16", 2,
    )  # fmt: skip
    assert (vision.engine.model, vision.engine.model_name, vision.engine.engine, vision.instruments.concept_pack) == (
        "/models/qwen2-vl", "vision", "vllm", "none",
    )  # fmt: skip
    assert (vision.engine.dtype, vision.vllm.tensor_parallel_size, vision.transformers.threads) == ("float32", 2, 2)


def test_without_models_the_top_level_settings_are_the_one_model(tmp_path: Path) -> None:
    settings = load(tmp_path, 'model_name = "only"\n')
    assert [s.engine.model_name for s in settings.served()] == ["only"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[[models]]\nname = "a"\ncolour = "red"\n', "unknown key(s) colour"),
        ('[[models]]\nmodel = "/m"\n', "name (config file {path}, [[models]] #1): must be a non-empty string"),
        ('[[models]]\nname = "a/b"\n', "without '/'"),
        ('[[models]]\nname = "a"\n[[models]]\nname = "a"\n', "must be unique"),
        (
            '[[models]]\nname = "a"\nengine = "onnx"\n',
            "engine (config file {path}, [[models]] #1, key engine): 'onnx' is not one of",
        ),
        (
            '[[models]]\nname = "a"\nthreads = "two"\n',
            "threads (config file {path}, [[models]] #1, key threads): 'two' is not valid",
        ),
        (
            '[[models]]\nname = "a"\nengine = "vllm"\nreplicas = 2\n',
            "replicas (config file {path}, [[models]] #1): must be 1",
        ),
        ("models = []\n", "non-empty list"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    assert fragment.format(path=tmp_path / "prismgate.toml") in str(e.value)


def test_models_and_the_model_flag_do_not_mix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, '[[models]]\nname = "a"\n', model="/elsewhere")
    assert str(e.value).startswith("model (flag --model): give the models either as [[models]]")


def test_the_example_in_the_scaling_guide_loads(tmp_path: Path) -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    example = guide.split("```toml\n", 1)[1].split("```", 1)[0]
    smollm2, qwen = load(tmp_path, example).served()
    assert (smollm2.engine.model, smollm2.engine.model_name, smollm2.engine.dtype) == (None, "smollm2", "bfloat16")
    assert (
        qwen.engine.model_name,
        qwen.instruments.concept_pack,
        qwen.engine.max_model_len,
        qwen.transformers.replicas,
    ) == ("qwen2-vl", "none", 8192, 2)
