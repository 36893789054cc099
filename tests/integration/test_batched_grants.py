"""Two ``extauthz serve`` processes sharing one Redis, with ``consistency: batched``: the
batched limit holds across them (never more than the limit; refusals early by at most
``batch x (replicas - 1)``), their grant counters are on /status and /metrics, and a
graceful stop gives every unspent grant back (fleet_usage: every free slot; the slots of
requests still in flight stay until their leases go). No timing: a ``sync_interval`` of 10 s keeps
the timers out of the run, and the bound holds whenever they run."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import pytest

from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.proto import auth_pb2_grpc
from testinfra.redis_servers import RedisSingle

from .test_two_replicas import check_request

pytestmark = pytest.mark.redis

LIMIT, BATCH, REPLICAS = 30, 4, 2
SPECS = {
    "quota": f"type: quota\n    limit: {LIMIT}\n    period: day",
    "request_rate": f"type: request_rate\n    rate: 0.001\n    burst: {LIMIT}",
    # no access log here: every admitted request stays in flight (its lease held)
    "fleet_usage": f"type: fleet_usage\n    capacity: {LIMIT}\n    reserved_for_critical: 0",
}


def policy(kind: str) -> str:
    return f"""\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: batched
    {SPECS[kind]}
    consistency: batched
    batch: {BATCH}
    sync_interval: 10s
"""


@contextmanager
def servers(path: Path, redis: RedisSingle, workdir: Path) -> Iterator[list[ServerProcess]]:
    args = ["--redis-url", redis.url, "--store-deadline-ms", "2000"]
    procs = [ServerProcess([path], args=[*args, "--metrics-listen", f"127.0.0.1:{free_port()}"],
                           workdir=workdir) for _ in range(REPLICAS)]
    with ExitStack() as stack:
        for p in procs:
            stack.enter_context(p)
        yield procs


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def metrics_url(proc: ServerProcess) -> str:
    return f"http://{proc.cmd[proc.cmd.index('--metrics-listen') + 1]}/metrics"


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_two_replicas_hold_the_batched_limit(tmp_path: Path, redis_single_clean: RedisSingle,
                                             kind: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy(kind))
    with servers(path, redis_single_clean, tmp_path) as procs:
        channels = [grpc.insecure_channel(f"127.0.0.1:{p.port}") for p in procs]
        try:
            stubs = [auth_pb2_grpc.AuthorizationStub(ch) for ch in channels]
            allowed = 0
            for i in range(2 * LIMIT):
                resp = stubs[i % REPLICAS].Check(check_request("sk_live_shared"), timeout=10)
                if resp.status.code == 0:
                    allowed += 1
                else:
                    assert resp.denied_response.status.code == (503 if kind == "fleet_usage" else 429)
            # never more than the exact limiter; early by at most batch x (replicas - 1)
            assert LIMIT - BATCH * (REPLICAS - 1) <= allowed <= LIMIT
            grants = [json.loads(get(f"http://127.0.0.1:{p.admin_port}/status"))["grants"]["batched"] for p in procs]
            assert sum(g["store_calls_saved"] for g in grants) > 0
            assert sum(g["grants_taken"] for g in grants) + sum(g["store_calls_saved"] for g in grants) >= allowed
            assert all(g["held"] <= BATCH for g in grants)
            assert all(g["overadmission"] == 0 for g in grants)
            metrics = get(metrics_url(procs[0]))
            assert 'extauthz_grant_store_calls_saved_total{limiter="batched"}' in metrics
            assert 'extauthz_grants_taken_total{limiter="batched"}' in metrics
            assert 'extauthz_overadmission_total{limiter="batched"} 0.0' in metrics
        finally:
            for ch in channels:
                ch.close()
    if kind == "quota":  # stopped gracefully: every unspent unit went back to the count
        with redis_single_clean.client() as raw:
            (key,) = raw.scan_iter("extauthz:*:q:batched:*")
            assert int(raw.get(key)) == allowed
    if kind == "fleet_usage":  # stopped gracefully: every free slot went back, the used stay
        with redis_single_clean.client() as raw:
            (key,) = raw.scan_iter("extauthz:*:fl:batched:other")
            assert raw.zcard(key) == allowed
