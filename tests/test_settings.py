"""Settings precedence: defaults < TOML < environment < flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from prismgate.core.errors import GatewayError
from prismgate.settings import Settings


def test_defaults_are_the_documented_ones() -> None:
    s = Settings.load(env={})
    assert (s.host, s.http_port, s.grpc_port, s.engine) == ("127.0.0.1", 8000, 50051, "transformers")
    assert s.session_ttl_s == 1800


def test_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text("[prismgate]\nhttp_port = 9000\ngrpc_port = 9001\nlog_json = true\n")
    env = {"PRISMGATE_GRPC_PORT": "9002", "PRISMGATE_CONFIG": str(cfg)}
    s = Settings.load({"log_json": False}, env=env)
    assert s.http_port == 9000  # from TOML
    assert s.grpc_port == 9002  # env beats TOML
    assert s.log_json is False  # flag beats TOML


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"PRISMGATE_HTTP_PORT": "eighty"}, "not a valid int"),
        ({"PRISMGATE_LOG_JSON": "maybe"}, "not a valid bool"),
        ({"PRISMGATE_ENGINE": "onnx"}, "engine must be one of"),
        ({"PRISMGATE_HTTP_PORT": "70000"}, "TCP port"),
    ],
)
def test_bad_values_are_clear(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(GatewayError) as e:
        Settings.load(env=env)
    assert fragment in e.value.message


def test_unknown_toml_keys_are_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "p.toml"
    cfg.write_text("htp_port = 1\n")
    with pytest.raises(GatewayError) as e:
        Settings.load(env={}, config_file=str(cfg))
    assert "unknown setting 'htp_port'" in e.value.message


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


def test_every_setting_is_in_exactly_one_help_section() -> None:
    from prismgate.settings import HELP_GROUPS

    named = [name for _, names in HELP_GROUPS for name in names]
    assert sorted(named) == sorted(f.name for f in Settings.fields())
