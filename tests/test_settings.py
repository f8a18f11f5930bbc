"""Settings precedence: defaults < TOML < environment < flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from prismgate.core.errors import GatewayError
from prismgate.settings import ConfigError, Settings


def test_defaults_are_the_documented_ones() -> None:
    s = Settings.load(env={})
    assert (s.server.host, s.server.http_port, s.server.grpc_port, s.engine.engine) == (
        "127.0.0.1",
        8000,
        50051,
        "transformers",
    )
    assert s.sessions.ttl_s == 1800


def test_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text("[prismgate]\nhttp_port = 9000\ngrpc_port = 9001\nlog_json = true\n")
    env = {"PRISMGATE_GRPC_PORT": "9002", "PRISMGATE_CONFIG": str(cfg)}
    s = Settings.load({"log_json": False}, env=env)
    assert s.server.http_port == 9000  # from TOML
    assert s.server.grpc_port == 9002  # env beats TOML
    assert s.observability.log_json is False  # flag beats TOML


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PRISMGATE_HTTP_PORT": "eighty"},
            "http_port (environment variable PRISMGATE_HTTP_PORT): 'eighty' is not a valid int",
        ),
        (
            {"PRISMGATE_LOG_JSON": "maybe"},
            "log_json (environment variable PRISMGATE_LOG_JSON): 'maybe' is not a valid bool",
        ),
        (
            {"PRISMGATE_ENGINE": "onnx"},
            "engine (environment variable PRISMGATE_ENGINE): 'onnx' is not one of transformers, vllm",
        ),
        (
            {"PRISMGATE_HTTP_PORT": "70000"},
            "http_port (environment variable PRISMGATE_HTTP_PORT): 70000 is not valid: expected int <= 65535",
        ),
        (
            {"PRISMGATE_GPU_MEMORY_UTILIZATION": "1.5"},
            "gpu_memory_utilization (environment variable PRISMGATE_GPU_MEMORY_UTILIZATION): 1.5 is not valid: "
            "expected float <= 1.0",
        ),
        # a rule between two settings names the one that breaks it, and where that one came from
        (
            {"PRISMGATE_RESERVED_SLOTS": "8", "PRISMGATE_MAX_ACTIVE": "8"},
            "reserved_slots (environment variable PRISMGATE_RESERVED_SLOTS): must be below max_active (8), got 8",
        ),
    ],
)
def test_bad_values_name_the_setting_and_its_source(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        Settings.load(env=env)
    assert str(e.value) == message


def test_a_bad_flag_value_names_the_flag() -> None:
    with pytest.raises(ConfigError) as e:
        Settings.load({"workers": 0}, env={})
    assert str(e.value) == "workers (flag --workers): 0 is not valid: expected int >= 1"
    with pytest.raises(ConfigError) as e:  # checked in code, not loaded: no source to name
        Settings().replace(max_active=1, reserved_slots=1).validate()
    assert str(e.value) == "reserved_slots: must be below max_active (1), got 1"


def test_a_bad_value_in_the_file_names_the_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text("[prismgate]\nhttp-port = 99999\n")
    with pytest.raises(ConfigError) as e:
        Settings.load(env={}, config_file=str(cfg))
    assert str(e.value) == f"http_port (config file {cfg}, key http-port): 99999 is not valid: expected int <= 65535"
    cfg.write_text('max_active = "64"\n')  # TOML has types: a string is not a number
    with pytest.raises(ConfigError) as e:
        Settings.load(env={}, config_file=str(cfg))
    assert str(e.value) == f"max_active (config file {cfg}, key max_active): '64' is not valid: expected int, got str"


def test_the_flat_toml_file_loads_as_before(tmp_path: Path) -> None:
    """Every setting is a top-level key (or one under [prismgate]); ints are taken for floats."""
    cfg = tmp_path / "p.toml"
    cfg.write_text("shutdown_grace_s = 5\nvllm_kv_cache_gb = 2\nslow-client-timeout-s = 1.5\nlog_json = true\n")
    s = Settings.load(env={}, config_file=str(cfg))
    assert (s.server.shutdown_grace_s, s.vllm.kv_cache_gb, s.streams.timeout_s) == (5.0, 2.0, 1.5)
    assert s.observability.log_json is True and isinstance(s.server.shutdown_grace_s, float)


def test_unknown_toml_keys_are_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text("htp_port = 1\n")
    with pytest.raises(ConfigError) as e:
        Settings.load(env={}, config_file=str(cfg))
    assert str(e.value) == f"config file {cfg}: unknown setting 'htp_port'"


def test_every_budget_limit_is_a_setting_and_reaches_the_core() -> None:
    """The request budget's limits are documented settings: none is a code constant only.

    Its model facts (hidden size, context) are not limits: the served models size them.
    """
    import dataclasses

    from prismgate.compose import build_budget
    from prismgate.core.budget import RequestBudget

    names = {f.name for f in dataclasses.fields(RequestBudget) if not f.metadata.get("derived")}
    assert names and {"hidden_size", "context"}.isdisjoint(names)
    assert names <= {f.name for f in Settings.fields()}
    settings = Settings.load({"max_stop_strings": 2, "max_json_depth": 5}, env={})
    budget = build_budget(settings)
    assert (budget.max_stop_strings, budget.max_json_depth) == (2, 5)
    with pytest.raises(GatewayError, match="3 stop strings; the limit is 2"):
        budget.check_lists(stop_strings=["a", "b", "c"])


def test_every_setting_is_in_exactly_one_help_section_and_names_are_unique() -> None:
    from prismgate.settings.flags import sections

    named = [spec.name for _, specs in sections() for spec in specs]
    assert len(named) == len(set(named)) == len(Settings.fields()) > 80


def test_public_names_map_to_their_groups() -> None:
    """The grouping is internal: flags, variables and keys keep their flat names."""
    s = Settings.load({"vllm_kv_cache_gb": 3.0, "slow_client_buffer_bytes": 7, "max_connections_per_client": 2}, env={})
    assert (s.vllm.kv_cache_gb, s.streams.buffer_bytes, s.http.max_connections_per_client) == (3.0, 7, 2)
    assert s.value("vllm_kv_cache_gb") == 3.0 and s.replace(vllm_kv_cache_gb=1.0).vllm.kv_cache_gb == 1.0
    specs = Settings.specs()
    assert (specs["http_keep_alive_s"].group, specs["http_keep_alive_s"].attr) == ("http", "keep_alive_s")
    assert specs["tensor_parallel_size"].env == "PRISMGATE_TENSOR_PARALLEL_SIZE"


def test_engine_options_are_the_engines_own_keywords_with_the_same_defaults() -> None:
    """Each engine's group passes through as keyword arguments: same names, same defaults (one place to look)."""
    import dataclasses
    import inspect

    from prismgate.engines.hf import TransformersEngine
    from prismgate.engines.vllm import VLLMEngine
    from prismgate.engines.vllm.config import Options

    s = Settings()
    for options, engine in ((s.transformers, TransformersEngine), (s.vllm, VLLMEngine)):
        params = inspect.signature(engine.__init__).parameters
        kwargs = options.engine_kwargs()
        assert kwargs and all(params[name].default == value for name, value in kwargs.items()), engine
    shared = {f.name: f.default for f in dataclasses.fields(Options) if f.name in s.vllm.engine_kwargs()}
    assert shared and shared == {name: s.vllm.engine_kwargs()[name] for name in shared}
