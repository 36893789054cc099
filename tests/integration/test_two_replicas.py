"""Two server processes sharing one Redis enforce one budget per user."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.proto import auth_pb2
from tests.infra.redis_servers import RedisSingle

from .replicas import replicas

pytestmark = pytest.mark.redis

BURST = 20
POLICY = f"""\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-rate
    type: request_rate
    rate: 0.001
    burst: {BURST}
"""


def check_request(key: str) -> auth_pb2.CheckRequest:
    req = auth_pb2.CheckRequest()
    http = req.attributes.request.http
    http.method, http.path, http.host = "GET", "/v1/things", "api.example.com"
    http.headers["x-api-key"] = key
    req.attributes.source.address.socket_address.address = "10.1.2.3"
    return req


def test_two_replicas_share_one_budget(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    # A generous store deadline: this test is about the shared budget, not latency (a
    # fail-open on a slow first call would admit more than the budget).
    args = ["--redis-url", redis_single_clean.url, "--store-deadline-ms", "2000"]
    with replicas(policy, 2, args=args, workdir=tmp_path) as stubs:
        allowed = [0, 0]
        for i in range(3 * BURST):
            replica = i % 2
            resp = stubs[replica].Check(check_request("sk_live_shared"), timeout=10)
            if resp.status.code == 0:
                allowed[replica] += 1
            else:
                assert resp.denied_response.status.code == 429
        assert sum(allowed) == BURST
        assert allowed == [BURST // 2, BURST // 2]  # alternating: each admitted its share
        # Another user has a budget of its own.
        assert stubs[1].Check(check_request("sk_live_other"), timeout=10).status.code == 0
    with redis_single_clean.client() as raw:
        buckets = [k for k in raw.scan_iter("extauthz:*:rr2:user-rate")]
        assert len(buckets) == 2  # the two users' buckets live in the shared Redis
