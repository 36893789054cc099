"""The fluentd release path through a real Envoy: ``extauthz envoy-config --access-log fluentd``
in front of ``serve --fluentd-listen``; a concurrent_requests lease is given back by Envoy's
fluentd access logger (not by its TTL, an hour here), on both protocols."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.devtools.upstream import start_upstream
from extauthz.envoy.config import bootstrap
from extauthz.policy import load_policy

pytestmark = pytest.mark.e2e

POLICY = {"version": 1, "identity": [{"header": "x-api-key"}],
          "limiters": [{"name": "user-concurrency", "type": "concurrent_requests", "limit": 1,
                        "lease_ttl": "3600s"}]}


def status(server: ServerProcess) -> dict[str, Any]:
    url = f"http://127.0.0.1:{server.admin_port}/status"
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_envoy_s_fluentd_log_releases_the_leases(tmp_path: Path, protocol: str) -> None:
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    http_port, fluentd_port = free_port(), free_port()
    upstream = start_upstream()
    args = ["--fluentd-listen", f"127.0.0.1:{fluentd_port}"]
    if protocol == "http":
        args += ["--http-listen", f"127.0.0.1:{http_port}"]
    server = ServerProcess([tmp_path], args=args)
    try:
        server.start()
        authz = ("127.0.0.1", server.port if protocol == "grpc" else http_port)
        config = bootstrap(load_policy([tmp_path]), protocol=protocol, upstream=("127.0.0.1", upstream.port),
                           authz=authz, access_log="fluentd", access_log_to=("127.0.0.1", fluentd_port),
                           listen_port=0, admin_port=0)
        assert [log["name"] for log in config["static_resources"]["listeners"][0]["filter_chains"][0]
                ["filters"][0]["typed_config"]["access_log"]] == ["envoy.access_loggers.fluentd"]
        with EnvoyProcess(yaml.safe_dump(config), concurrency=1) as envoy, HttpClient() as c:
            # limit 1, a lease an hour long: each request after the first is admitted only once
            # the previous one's lease came back through the fluentd port
            for i in range(5):
                deadline = time.monotonic() + 10
                while (code := c.send(envoy.url + f"/v1/x?{i}", headers={"x-api-key": "k"}).status) == 429:
                    assert time.monotonic() < deadline, f"request {i}: the lease never came back"
                    time.sleep(0.01)
                assert code == 200
            deadline = time.monotonic() + 10
            while status(server)["store"]["live_leases"] and time.monotonic() < deadline:
                time.sleep(0.01)
            doc = status(server)
        assert doc["store"]["live_leases"] == {}
        assert doc["fluentd"]["messages"] >= 1 and doc["fluentd"]["malformed"] == {}
        released = doc["lease_releases"]["by_path"]
        assert released["access_log"]["released"] == 5
        assert doc["access_log"]["rejected"] == {}
    finally:
        server.stop()
        upstream.stop()
