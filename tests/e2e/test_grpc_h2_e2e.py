"""Through a real Envoy (the shipped envoy/envoy.yaml, plus a gRPC health check of the
extauthz cluster) to each gRPC server kind (``serve --grpc-server asyncio``, the default, and
``grpcio``): checks decided, 429 answers, the access log stream releasing leases, Envoy's
health checks answered."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

pytestmark = pytest.mark.e2e

WAIT = 15.0


def _with_health_check(config: dict[str, Any]) -> None:
    """envoy/envoy.yaml with Envoy's gRPC health check on the extauthz cluster."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "extauthz":
            cluster["health_checks"] = [{"timeout": "1s", "interval": "0.2s", "no_traffic_interval": "0.2s",
                                         "unhealthy_threshold": 2,
                                         "healthy_threshold": 1, "grpc_health_check": {}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, grpc_server_kind: str) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("h2e2e")
    (d / "policy.yaml").write_text(yaml.safe_dump({
        "version": 1, "identity": [{"header": "x-api-key"}],
        "limiters": [{"name": "user-rate", "type": "request_rate", "rate": 1, "burst": 3},
                     {"name": "user-concurrency", "type": "concurrent_requests", "limit": 10,
                      "lease_ttl": "60s"}]}))
    with Stack([d / "policy.yaml"], server_args=["--grpc-server", grpc_server_kind],
               edit=_with_health_check) as s:
        yield s


def _status(stack: Stack) -> Any:
    assert stack.server is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.server.admin_port}/status", timeout=5) as resp:
        return json.load(resp)


def test_checks_decided_and_leases_released_by_the_access_log(stack: Stack) -> None:
    if stack.server_args[1] == "asyncio":  # (grpcio's port has no /status section)
        assert _status(stack)["grpc"]["server"] == "asyncio"
    with HttpClient() as client:
        r = client.send(stack.url + "/v1/customers", headers={"x-api-key": "sk_live_a"})
        assert r.status == 200 and r.tier == "get"
        assert r.headers["ratelimit"].startswith('"user-rate";r=2;t=')
        statuses = [client.send(stack.url + "/v1/customers", headers={"x-api-key": "sk_live_b"}).status
                    for _ in range(6)]
        assert statuses[:3] == [200, 200, 200] and 429 in statuses[3:], statuses
        refused = client.send(stack.url + "/v1/customers", headers={"x-api-key": "sk_live_b"})
        if refused.status == 429:
            assert refused.headers["content-type"] == "application/problem+json"
            assert json.loads(refused.body)["limiter"] == "user-rate"
    deadline = time.monotonic() + WAIT  # every admitted request's lease comes back
    while time.monotonic() < deadline and _status(stack)["store"]["live_leases"]:
        time.sleep(0.05)
    status = _status(stack)
    assert status["store"]["live_leases"] == {}
    assert status["lease_releases"]["leases_released"] >= 4


def test_envoys_grpc_health_checks_are_answered(stack: Stack) -> None:
    assert stack.envoy is not None
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        stats = stack.envoy.stats(r"^cluster\.extauthz\.(health_check\.(success|failure)|membership_healthy)$")
        if stats.get("cluster.extauthz.health_check.success", 0) >= 2:
            break
        time.sleep(0.05)
    assert stats["cluster.extauthz.health_check.success"] >= 2
    assert stats.get("cluster.extauthz.health_check.failure", 0) == 0
    assert stats["cluster.extauthz.membership_healthy"] == 1


def test_the_server_logged_no_failure(stack: Stack) -> None:
    assert stack.server is not None
    text = stack.server.log()
    assert "Traceback" not in text and '"level":"error"' not in text, text[-3000:]
