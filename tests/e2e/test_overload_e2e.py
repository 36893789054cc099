"""Overload is decided, not timed out, through a real Envoy (extauthz/engine/overload.py): the server
stopped (SIGSTOP) with requests waiting at Envoy, for longer than half its check budget and
less than Envoy's timeout (rendered by ``envoy-config --check-budget-ms``: the budget plus
50 ms). When it runs again its fleet shedder refuses the non-critical requests (503,
``overload``) and lets the critical ones through, within Envoy's timeout: Envoy lets none
through unchecked (``ext_authz.failure_mode_allowed`` stays 0)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from extauthz.devtools.client import HttpClient, Result
from extauthz.devtools.stack import Stack
from extauthz.engine.answers import PROBLEM_TYPE
from extauthz.envoy.config import render
from extauthz.policy import load_policy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: the server's check budget: half of it is the stall that makes it starved; Envoy waits it
#: plus 50 ms, which leaves a slow machine 1.65 s to answer after the 2.4 s stall
BUDGET_MS = 4000
POLICY = """\
version: 1
identity: [{header: x-api-key}]
classification:
  route_metadata_namespace: extauthz
  rules:
    - match: {methods: [POST], path_prefix: /v1/charges}
      tier: critical
limiters:
  - {name: fleet, type: fleet_usage, capacity: 16, reserved_for_critical: 0.25}
"""
UNCHECKED = "http.ingress_http.ext_authz.failure_mode_allowed"


def stalled(stack: Stack, pool: ThreadPoolExecutor, send: Callable[[], Result], n: int) -> list[Result]:
    """``n`` requests sent through Envoy while the server is stopped for 0.6 of the budget."""
    assert stack.server is not None and stack.server.proc is not None
    pid = stack.server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        futures = [pool.submit(send) for _ in range(n)]
        time.sleep(BUDGET_MS / 1000 * 0.6)  # the stall (what is checked is its outcome)
    finally:
        os.kill(pid, signal.SIGCONT)
    return [f.result(timeout=60) for f in futures]


def test_a_starved_server_s_shedder_refuses_instead_of_envoy_timing_out(tmp_path: Path) -> None:
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "p.yaml").write_text(POLICY)
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(render(load_policy([policy]), protocol="grpc", upstream=("127.0.0.1", 8080),
                            tracing=("127.0.0.1", 4317), quickstart_routes=True, check_budget_ms=BUDGET_MS))
    [ext] = [f for f in yaml.safe_load(envoy.read_text())["static_resources"]["listeners"][0]["filter_chains"][0]
             ["filters"][0]["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.ext_authz"]
    assert ext["typed_config"]["grpc_service"]["timeout"] == "4.05s"
    with Stack([policy], check_budget_ms=BUDGET_MS, server_args=["--check-budget-ms", str(BUDGET_MS)]) as stack, \
            HttpClient(timeout=30) as client, ThreadPoolExecutor(8) as pool:
        assert stack.envoy is not None
        url = stack.url
        key = {"x-api-key": "sk_live_starved"}
        assert client.send(url + "/v1/customers", "GET", key).status == 200

        refused = stalled(stack, pool, lambda: client.send(url + "/v1/customers", "GET", key), 4)
        assert [r.status for r in refused] == [503] * 4, [(r.status, r.body) for r in refused]
        for r in refused:
            assert r.limiter == "fleet" and r.json()["type"] == PROBLEM_TYPE + "overload", r.body  # type: ignore[index]

        passed = stalled(stack, pool, lambda: client.send(url + "/v1/charges", "POST", key), 4)
        assert [r.status for r in passed] == [200] * 4, [(r.status, r.body) for r in passed]
        assert {r.tier for r in passed} == {"critical"}

        # every one of them was decided by the server: Envoy let none through unchecked
        stats = stack.envoy.stats(r"^http\.ingress_http\.ext_authz\.")
        assert stats[UNCHECKED] == 0 and stats["http.ingress_http.ext_authz.denied"] == 4, stats
