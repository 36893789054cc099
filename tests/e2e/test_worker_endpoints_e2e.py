"""``serve --workers N --worker-ports`` behind an Envoy whose ``extauthz`` cluster lists the N
ports as N endpoints (the generator's ``authz_endpoints=N``, ``Stack(server_workers=N)``):
Envoy itself spreads the Checks, even with one worker thread and so one connection per endpoint
(SO_REUSEPORT on one port would send them all to one process)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack, free_port_block
from testinfra.redis_servers import RedisSingle

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]

WORKERS = 3
POLICY = "version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n" \
         "  - {name: user-rate, type: request_rate, rate: 1000, burst: 1000}\n"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def checks_answered(metrics_port: int) -> float:
    """``extauthz_requests_total`` summed over tiers and results, from one process."""
    with _OPENER.open(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^extauthz_requests_total\{[^}]*\} (\S+)$", text, re.M))


def test_checks_reach_every_worker_process(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    metrics = free_port_block(WORKERS)  # worker i serves /metrics on metrics + i
    # a generous store deadline: a fresh worker's first Redis connection may be slow here
    args = ["--redis-url", redis_single_clean.url, "--metrics-listen", f"127.0.0.1:{metrics}",
            "--store-deadline-ms", "2000"]
    with Stack([policy], server_args=args, server_workers=WORKERS, tracing=None) as stack, \
            HttpClient() as client:
        assert stack.server is not None
        requests = 10 * WORKERS
        for i in range(requests):
            r = client.send(stack.url + "/v1/items", headers={"x-api-key": f"sk_live_{i}"})
            assert r.status == 200
            assert r.tier  # answered by a server (fail-open would leave no tier)
        answered = [checks_answered(metrics + i) for i in range(WORKERS)]
    assert sum(answered) == requests, answered
    assert all(n > 0 for n in answered), answered  # every process took Checks
