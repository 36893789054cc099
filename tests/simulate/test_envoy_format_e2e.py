"""The shipped ``envoy/access-log-json.yaml`` makes a real Envoy write lines simulate reads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from extauthz.commands.cli import main
from extauthz.commands.simulate.traffic import parse_line
from extauthz.devtools.client import HttpClient
from extauthz.devtools.envoy_config import local_render
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.upstream import start_upstream
from extauthz.policy import load_policy
from testinfra.envoy_configs import config_path

from ..conftest import ROOT

pytestmark = pytest.mark.e2e


def test_envoy_json_access_log_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_path = tmp_path / "traffic.jsonl"
    item = yaml.safe_load(config_path("access-log-json.yaml").read_text())  # shipped: envoy/
    assert isinstance(item, list) and len(item) == 1
    item[0]["typed_config"]["path"] = str(log_path)
    with start_upstream() as upstream:
        config = yaml.safe_load(local_render(load_policy([ROOT / "policies"]), protocol="grpc", grpc_port=9,
                                             upstream_port=upstream.port, quickstart_routes=True, ext_authz=False))
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm.setdefault("access_log", []).extend(item)
        started = time.time()
        with EnvoyProcess(yaml.safe_dump(config)) as envoy, HttpClient() as client:
            key = {"x-api-key": "sk_live_alice"}
            assert client.send(envoy.url + "/v1/reports/daily?day=1", headers=key).status == 200
            assert client.send(envoy.url + "/v1/charges", "POST", key).status == 200
            assert client.send(envoy.url + "/v1/slow?delay=0.3", headers=key).status == 200
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (
                    not log_path.exists() or len(log_path.read_text().splitlines()) < 3):
                time.sleep(0.05)
    raw = [json.loads(x) for x in log_path.read_text().splitlines()]
    reqs = [parse_line(obj, f"traffic.jsonl:{i}") for i, obj in enumerate(raw, 1)]
    assert all(not isinstance(r, str) for r in reqs), reqs
    by_path = {r.path: r for r in reqs if not isinstance(r, str)}
    assert set(by_path) == {"/v1/reports/daily", "/v1/charges", "/v1/slow"}
    reports, charges, slow = by_path["/v1/reports/daily"], by_path["/v1/charges"], by_path["/v1/slow"]
    assert reports.tier == "get" and charges.tier == "critical" and slow.tier is None
    assert charges.method == "POST" and reports.headers == {"x-api-key": "sk_live_alice"}
    assert started - 1 <= reports.time <= time.time()
    assert slow.duration is not None and slow.duration >= 0.3
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"version": 1, "identity": [{"header": "x-api-key"}], "limiters": [
        {"name": "tiny", "type": "request_rate", "rate": 0.1, "burst": 2}]}))
    out = tmp_path / "s.json"
    assert main(["simulate", "--policies", str(policy), "--traffic", str(log_path), "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert (s["requests"], s["allowed"], s["refused"]) == (3, 2, 1)
    assert s["by_tier"]["critical"]["requests"] == 1
