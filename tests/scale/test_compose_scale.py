"""The compose ``scale`` profile: two replicas sharing Redis, behind the nginx config the tests run."""

from __future__ import annotations

import re

from prismgate.settings import Settings
from tests.ops.test_deploy import COMPOSE, ROOT, container_ports, load_yaml
from tests.scale.conftest import NGINX_CONFIG


def test_the_scale_profile_wires_replicas_redis_and_nginx() -> None:
    services = load_yaml(COMPOSE)["services"]
    scale = {name for name, s in services.items() if "scale" in s.get("profiles", [])}
    assert scale == {"gateway-a", "gateway-b", "redis", "nginx", "prometheus"}
    for name in ("gateway-a", "gateway-b"):
        replica = services[name]
        assert replica["environment"]["PRISMGATE_SESSION_STORE"] == "redis://redis:6379/0"
        assert replica["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "/readyz" in " ".join(replica["healthcheck"]["test"])
        assert container_ports(replica) == {8000, 50051}
    assert "noeviction" in services["redis"]["command"]  # a full Redis refuses writes, never drops a session
    nginx = services["nginx"]
    (mount,) = nginx["volumes"]
    source, target, _ = mount.split(":")
    assert (ROOT / source).resolve() == NGINX_CONFIG and target == "/etc/nginx/nginx.conf"
    assert all(nginx["depends_on"][n]["condition"] == "service_healthy" for n in ("gateway-a", "gateway-b"))
    assert container_ports(nginx) == {8000, 50051}


def test_nginx_hashes_on_the_session_and_reaches_every_replica_on_both_ports() -> None:
    text = NGINX_CONFIG.read_text()
    upstreams = dict(re.findall(r"upstream (\w+) \{(.*?)\}", text, flags=re.S))
    for name, port in (("prismgate_http", 8000), ("prismgate_grpc", 50051)):
        body = upstreams[name]
        assert "hash $prismgate_affinity consistent;" in body
        assert re.findall(r"server ([\w-]+):(\d+)", body) == [("gateway-a", str(port)), ("gateway-b", str(port))]
    assert "$http_x_session_id" in text and "grpc_pass grpc://prismgate_grpc;" in text
    assert "proxy_set_header Upgrade $http_upgrade;" in text  # WebSockets (Evergreen)
    # A killed replica's address drops connection attempts: without a short connect timeout
    # nginx waits its default 60 s before trying the other one (measured by tests/compose).
    assert "proxy_connect_timeout 3s;" in text and "grpc_connect_timeout 3s;" in text


def test_the_per_client_connection_cap_moves_to_nginx() -> None:
    """Behind nginx every connection comes from nginx's address: a replica's own cap would count all
    clients as one, so the replicas run without it and nginx caps each real client, at the same default."""
    services = load_yaml(COMPOSE)["services"]
    for name in ("gateway-a", "gateway-b"):
        assert services[name]["environment"]["PRISMGATE_MAX_CONNECTIONS_PER_CLIENT"] == "0"
    text = NGINX_CONFIG.read_text()
    assert "limit_conn_zone $binary_remote_addr zone=prismgate_per_client:" in text
    assert "limit_conn_status 503;" in text  # what a replica answers past its cap
    servers = re.findall(r"\n    server \{(.*?)\n    \}", text, flags=re.S)
    assert len(servers) == 2  # HTTP and gRPC
    default = Settings.load({}, env={}).http.max_connections_per_client
    for body in servers:
        assert f"limit_conn prismgate_per_client {default};" in body
