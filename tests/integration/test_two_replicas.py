"""Two server processes sharing one Redis enforce one budget per user."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from extauthz.proto import auth_pb2
from testinfra.redis_servers import RedisSingle

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


QUOTA = 10
QUOTA_POLICY = f"""\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: daily
    type: quota
    limit: {QUOTA}
    period: day
  - name: per-ip
    type: request_rate
    rate: 0.001
    burst: 1000
    key: [{{source_ip: true}}]
"""


def test_two_replicas_share_one_quota_count_that_survives_a_restart(
        tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(QUOTA_POLICY)
    args = ["--redis-url", redis_single_clean.url, "--store-deadline-ms", "2000"]
    with replicas(policy, 2, args=args, workdir=tmp_path) as stubs:
        allowed = [0, 0]
        for i in range(2 * QUOTA):
            resp = stubs[i % 2].Check(check_request("sk_live_shared"), timeout=10)
            if resp.status.code == 0:
                allowed[i % 2] += 1
                continue
            denied = resp.denied_response
            assert denied.status.code == 429
            headers = {h.header.key: h.header.value for h in denied.headers}
            now = time.time()
            to_midnight = 86400 - now % 86400
            assert 0 < int(headers["retry-after"]) <= math.ceil(to_midnight) + 1
            assert headers["ratelimit-policy"].startswith(f'"daily";q={QUOTA};w=86400')
            assert json.loads(denied.body)["reset"].endswith("T00:00:00Z")
        assert allowed == [QUOTA // 2, QUOTA // 2]
    with redis_single_clean.client() as raw:
        [count_key] = list(raw.scan_iter("extauthz:*:q:daily:*"))
        assert raw.get(count_key) == str(QUOTA)
        # The key expires at the window's end plus the margin (an hour), whole seconds rounded
        # up from the server's clock: an absolute expiry, so the machine's speed cannot move it.
        window_end = int(str(count_key).rsplit(":", 1)[1]) + 86400
        expires_at = int(raw.expiretime(count_key))
        assert window_end + 3600 <= expires_at <= window_end + 3600 + 3  # + the ceil and the call's own time
    # a restarted server reads the same count
    with replicas(policy, 1, args=args, workdir=tmp_path) as stubs:
        assert stubs[0].Check(check_request("sk_live_shared"), timeout=10).status.code != 0
        assert stubs[0].Check(check_request("sk_live_other"), timeout=10).status.code == 0
