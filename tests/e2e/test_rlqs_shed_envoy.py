"""A shedder pushed to Envoy (``envoy_deny_all``, docs/rlqs.md "Shedders in Envoy") through a
real Envoy 1.40: the worker_utilization shedder on Redis, driven by its ``redis`` signal on a
short timescale, sheds test, get and post traffic whole; at its next report Envoy's quota
filter gets DENY_ALL for those tiers' buckets and refuses them itself (the problem body of
the shedder, 503): the upstream sees none of them and the server checks none of them, while
critical traffic passes, checked and served. When utilization falls, ALLOW_ALL comes back at
a report and the tiers reach the server again (its ramp decides)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.devtools.client import HttpClient, Result
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.devtools.upstream import Upstream, start_upstream
from extauthz.engine.answers import PROBLEM_TYPE
from extauthz.engine.quota_service import REPORT_INTERVAL
from extauthz.envoy.blocks import TlsFiles
from extauthz.envoy.config import bootstrap
from extauthz.policy import load_policy
from testinfra.envoy_configs import validate
from testinfra.redis_servers import RedisSingle

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]

SIGNAL_KEY = "extauthz:signal:workers"
POLICY = """\
version: 1
identity: [{header: x-api-key}]
test_mode: {header: x-test}
classification:
  rules:
    - {match: {path_prefix: /v1/charges, methods: [POST]}, tier: critical}
limiters:
  - name: workers
    type: worker_utilization
    signal: {source: redis}
    sample_interval: 0.2s
    delay_before_shedding: 0.5s
    time_to_shed_all: 1s
    envoy_deny_all: true
"""
#: one request shape per tier, as the policy classifies it
TIERS = {
    "test": ("GET", "/v1/customers", {"x-test": "true"}),
    "get": ("GET", "/v1/customers", {}),
    "post": ("POST", "/v1/customers", {}),
    "critical": ("POST", "/v1/charges", {}),
}
#: how long the server or Envoy may take to start on a loaded machine (no measurement here)
STARTUP = 60.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> str:
    with _OPENER.open(url, timeout=5) as resp:
        text: str = resp.read().decode()
    return text


def checks(metrics_port: int) -> dict[str, float]:
    """The server's checks by tier (``extauthz_requests_total`` summed over results)."""
    out: dict[str, float] = {}
    text = _get(f"http://127.0.0.1:{metrics_port}/metrics")
    for m in re.finditer(r'^extauthz_requests_total\{([^}]*)\} (\S+)$', text, re.M):
        tier = re.search(r'tier="([^"]*)"', m.group(1))
        if tier is not None:
            out[tier.group(1)] = out.get(tier.group(1), 0.0) + float(m.group(2))
    return out


def quota(server: ServerProcess) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(_get(f"http://127.0.0.1:{server.admin_port}/status"))["quota"]
    return doc


def served_at_least(upstream: Upstream, n: int) -> int:
    """The upstream's count once it reaches ``n`` (it counts a request after answering it: a
    moment after the client has the answer), or what it is after a second."""
    for _ in range(50):
        if upstream.served >= n:
            break
        time.sleep(0.02)
    return upstream.served


#: the rules the server sends each tier's bucket while test, get and post are shed whole
PUSHED = {"test": "DENY_ALL", "get": "DENY_ALL", "post": "DENY_ALL", "critical": "ALLOW_ALL"}


def rules(server: ServerProcess) -> dict[str, str]:
    """The blanket rule the server last sent each tier's bucket (its one stream)."""
    streams = quota(server)["streams"]
    return {b["bucket"]["tier"]: b["rule"] for s in streams for b in s["buckets"]}


def send(client: HttpClient, envoy: EnvoyProcess, tier: str) -> Result:
    method, path, headers = TIERS[tier]
    return client.send(envoy.url + path, method, dict(headers, **{"x-api-key": "sk_live_1"}))


def test_envoy_refuses_a_tier_shed_whole_while_critical_passes(tmp_path: Path,
                                                               redis_single_clean: RedisSingle) -> None:
    (tmp_path / "api.yaml").write_text(POLICY)
    r = redis_single_clean.client()
    r.set(SIGNAL_KEY, "0.0")
    metrics = free_port()
    upstream = start_upstream()
    server = ServerProcess([tmp_path], args=["--redis-url", redis_single_clean.url,
                                              "--metrics-listen", f"127.0.0.1:{metrics}"]).start(STARTUP)
    config = yaml.safe_dump(bootstrap(load_policy([tmp_path]), protocol="grpc", upstream=("127.0.0.1", upstream.port),
                                      authz=("127.0.0.1", server.port), listen_port=0, admin_port=0, rlqs=True))
    try:
        with EnvoyProcess(config, startup_timeout=STARTUP) as envoy, HttpClient() as client:
            # calm: every tier's bucket is created (ALLOW_ALL before an assignment) and checked
            calm = {t: send(client, envoy, t) for t in TIERS}
            assert {t: (a.status, a.tier) for t, a in calm.items()} == {t: (200, t) for t in TIERS}
            assert served_at_least(upstream, 4) == 4
            r.set(SIGNAL_KEY, "1.0")  # every worker busy: test, get, post shed whole within ~1.5 s
            # Envoy gets DENY_ALL for them at its next report (every 5 s), not before: wait for
            # the rule the server last sent each bucket (not a count of DENY_ALLs, which a
            # report reaches while the ramp has shed only test and get whole)
            deadline = time.monotonic() + 3 * REPORT_INTERVAL + 3
            while rules(server) != PUSHED and time.monotonic() < deadline:
                for tier in TIERS:  # traffic meanwhile: the server's shedder refuses it
                    send(client, envoy, tier)
                time.sleep(0.2)
            assert rules(server) == PUSHED
            # the answer's way to Envoy (a loaded machine can take a moment): the first
            # refusal of each tier, bounded; the checks below count from after it
            # refusal of all three that no check counted (the check's shedder answers 503 too)
            for _ in range(100):
                counted = checks(metrics)
                statuses = {t: send(client, envoy, t).status for t in ("test", "get", "post")}
                if set(statuses.values()) == {503} and checks(metrics) == counted:
                    break
                time.sleep(0.05)
            assert set(statuses.values()) == {503} and checks(metrics) == counted
            # Envoy's own health route is in no bucket: a tier shed whole never fails a probe
            health = client.send(envoy.url + "/healthz", "GET", {})
            assert (health.status, health.body) == (200, "ok\n")
            served, before = upstream.served, checks(metrics)
            for _ in range(5):
                for tier in ("test", "get", "post"):
                    refused = send(client, envoy, tier)
                    assert refused.status == 503, (tier, refused.status, refused.body)
                    assert refused.headers.get("content-type") == "application/problem+json"
                    assert refused.headers.get("retry-after") == "1"
                    body = json.loads(refused.body)
                    assert (body["type"], body["limiter"], body["tier"]) == (
                        f"{PROBLEM_TYPE}shedding_{tier}", "workers", tier)
                assert send(client, envoy, "critical").status == 200
            # refused in Envoy: neither the upstream nor the server saw a shed tier's request
            assert served_at_least(upstream, served + 5) - served == 5
            time.sleep(0.2)  # anything more on its way arrives
            assert upstream.served - served == 5
            after = checks(metrics)
            assert {t: after.get(t, 0) - before.get(t, 0) for t in TIERS} == {
                "test": 0, "get": 0, "post": 0, "critical": 5}
            assert rules(server) == PUSHED
            # utilization falls: ALLOW_ALL comes back at a report, the tiers reach the server again
            r.set(SIGNAL_KEY, "0.0")
            deadline = time.monotonic() + 2 * REPORT_INTERVAL + 3
            back: dict[str, int] = {}
            while len(back) < 3 and time.monotonic() < deadline:
                for tier in ("test", "get", "post"):
                    if tier not in back and send(client, envoy, tier).status == 200:
                        back[tier] = len(back)
                time.sleep(0.2)
            assert set(back) == {"test", "get", "post"}, back
            assert quota(server)["overadmission"] == 0
    finally:
        server.stop()
        upstream.stop()


#: every tier source a pushed shedder takes: the test header, rules on methods, path and headers
RULES_POLICY = POLICY.replace(
    "    - {match: {path_prefix: /v1/charges, methods: [POST]}, tier: critical}\n",
    "    - {match: {path_prefix: /v1/charges, methods: [POST, put]}, tier: critical}\n"
    "    - {match: {headers: {X-Batch: 'yes'}, methods: [GET]}, tier: test}\n"
    "    - {match: {path_prefix: /v1/search}, tier: post}\n") + (
    "  - {name: m-rate, type: request_rate, rate: 1, burst: 2, key: [{method: true}], enforce: envoy}\n")


def test_a_pushed_shedder_s_config_is_valid_with_several_replicas_and_tls(tmp_path: Path) -> None:
    """``envoy --mode validate`` of what ``envoy-config --rlqs`` renders for a pushed shedder
    whose tiers come from every source it takes (case-free method matchers, header and path
    matchers under the /healthz exclusion), beside a limiter keyed on the method (a matcher
    per method), with two replicas behind one cluster: by address,
    by one host name on two ports, and over mTLS to every endpoint."""
    from ..infra.certs import CA

    (tmp_path / "api.yaml").write_text(RULES_POLICY)
    policy = load_policy([tmp_path])
    ca = CA()
    ca.write(tmp_path / "ca.crt")
    ca.issue("envoy").write(tmp_path, "tls")
    tls = TlsFiles(f"{tmp_path}/tls.crt", f"{tmp_path}/tls.key", f"{tmp_path}/ca.crt")
    for authz, more, files in ((("10.0.0.1", 9001), (("10.0.0.2", 9001),), None),
                               (("extauthz.svc", 9001), (("extauthz.svc", 9002),), tls),
                               (("10.0.0.1", 9001), (("10.0.0.2", 9001),), tls)):
        config = bootstrap(policy, protocol="grpc", upstream=("127.0.0.1", 8080), rlqs=True, authz=authz,
                           authz_more=more, tls=files)
        validate(yaml.safe_dump(config))
        (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "extauthz"]
        assert ("transport_socket" in cluster) == (files is not None)
