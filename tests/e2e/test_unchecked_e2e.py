"""Requests Envoy lets through without our decision (``failure_mode_allow``: the check timed
out because the server was stopped) are counted by tier where the operator looks: the access
log carries Envoy's fail-open header back, ``extauthz_unchecked_requests_total{tier}`` and
``/status`` ``unchecked_requests`` count them; checked requests are never counted. Through a
real Envoy with the shipped config (envoy/envoy.yaml) and the quick start's policies/."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack, free_port

from ..conftest import ROOT
from .waits import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    metrics_port = free_port()
    with Stack([ROOT / "policies"], server_args=["--metrics-listen", f"127.0.0.1:{metrics_port}"]) as s:
        s.metrics_port = metrics_port  # type: ignore[attr-defined]
        yield s


def get(url: str) -> str:
    with _OPENER.open(url, timeout=10) as resp:
        return str(resp.read().decode())


def status(stack: Stack) -> dict[str, Any]:
    assert stack.server is not None
    doc: dict[str, Any] = json.loads(get(f"http://127.0.0.1:{stack.server.admin_port}/status"))
    return doc


def unchecked_metric(stack: Stack) -> dict[str, float]:
    text = get(f"http://127.0.0.1:{stack.metrics_port}/metrics")  # type: ignore[attr-defined]
    out = {}
    for line in text.splitlines():
        if line.startswith("extauthz_unchecked_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('tier="')[1].split('"')[0]] = float(value)
    return out


#: (method, path, headers, the tier the server counts it under): the route names the tier
#: (route metadata, the access log's route-tier tag), the test header, the method default
REQUESTS = (("POST", "/v1/charges", {}, "critical"), ("GET", "/v1/reports", {}, "get"),
            ("GET", "/v1/x", {"x-test-mode": "true"}, "test"), ("PUT", "/v1/x", {}, "post"))


def send_all(stack: Stack, client: HttpClient) -> list[Any]:
    return [client.send(stack.url + path, method, {"x-api-key": "sk_live_unchecked", **headers})
            for method, path, headers, _ in REQUESTS]


def test_requests_envoy_fails_open_are_counted_by_tier_checked_ones_never(
        stack: Stack, client: HttpClient) -> None:
    assert stack.server is not None and stack.server.proc is not None
    before = status(stack)["access_log"]["entries"]
    checked = send_all(stack, client)  # the server answers: a decision of ours
    assert [r.status for r in checked] == [200] * len(REQUESTS)
    assert not any("x-envoy-auth-failure-mode-allowed" in json.loads(r.body)["headers"] for r in checked)
    wait_for(lambda: status(stack)["access_log"]["entries"] >= before + len(REQUESTS))
    assert status(stack)["unchecked_requests"]["total"] == 0

    pid = stack.server.proc.pid
    os.kill(pid, signal.SIGSTOP)  # every check now outlasts Envoy's ext_authz timeout
    try:
        unchecked = send_all(stack, client)
        assert client.send(stack.url + "/healthz").status == 200  # never reaches ext_authz: not counted
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [r.status for r in unchecked] == [200] * len(REQUESTS)  # failure_mode_allow let them through
    for r in unchecked:
        assert json.loads(r.body)["headers"]["x-envoy-auth-failure-mode-allowed"] == "true"

    want = {tier: 0 for tier in ("critical", "post", "get", "test", "unknown")}
    for *_, tier in REQUESTS:
        want[tier] += 1
    found = wait_for(lambda: (s := status(stack)["unchecked_requests"])["total"] >= len(REQUESTS) and s)
    assert {k: found[k] for k in ("total", "by_tier")} == {"total": len(REQUESTS), "by_tier": want}
    assert unchecked_metric(stack) == {tier: float(n) for tier, n in want.items()}

    # checked again: counted nowhere (once the stall's backlog is over: the server stays
    # starved for as long as it was stopped, at most its check budget, docs/limiters.md)
    wait_for(lambda: not status(stack)["overload"]["starved"])
    before = status(stack)["access_log"]["entries"]
    assert [r.status for r in send_all(stack, client)] == [200] * len(REQUESTS)
    wait_for(lambda: status(stack)["access_log"]["entries"] >= before + len(REQUESTS))
    assert status(stack)["unchecked_requests"]["total"] == len(REQUESTS)
