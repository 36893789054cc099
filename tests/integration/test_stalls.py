"""Three ``extauthz serve`` processes on one real Redis, every limiter ``consistency:
batched``: replica A holds fleet slots in use and unspent grants, then stands still
(SIGSTOP for 0.5, 1.5 and 3 s, longer than the fleet grant TTL of 1 s) or dies (``kill
-9``) while B and C admit what they can. Never more non-critical requests in flight than
``capacity`` (fleet_usage: no access log here, so every admitted request stays in flight),
never more admitted than the exact limit (quota, request_rate: a bucket that does not refill
within the test), and ``overadmission`` 0 on /status and /metrics. One server set-up for
every stall: each stall has limiters of its own (``applies_to`` a path of its own).

Before the fix, a stall of 1.5 or 3 s let B and C admit 10 fleet requests more than
capacity (A's grant members expired after the TTL while its requests were in flight).
The same on one injected clock, and request_rate's stale grants: tests/store/test_stalls.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.proto import auth_pb2_grpc
from testinfra.redis_servers import RedisSingle

from .test_batched_grants import metrics_url
from .test_two_replicas import check_request

#: serial: under a second xdist worker's load (2 cores) the 0.5 s stall once let B and C admit
#: 31 fleet requests of 30 (a fresh-clone CI, 2026-11-29); not reproduced alone with two CPU
#: hogs (5 runs), cause not found: it runs alone until it is (docs/limiters.md, Stalls)
pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.serial]

LIMIT, REPLICAS = 30, 3
#: the stalls, in order; None: ``kill -9`` (last: A is gone after it)
STALLS: tuple[float | None, ...] = (0.5, 1.5, 3.0, None)
KINDS = {
    "fleet": f"type: fleet_usage\n    capacity: {LIMIT}\n    reserved_for_critical: 0\n    batch: 10",
    "quota": f"type: quota\n    limit: {LIMIT}\n    period: day\n    batch: 4",
    "rate": f"type: request_rate\n    rate: 0.001\n    burst: {LIMIT}\n    batch: 4",
}
#: requests A sends before it stalls: fleet 10 in flight (its whole grant in use); a quota
#: and a rate grant of 4 with 2 left unspent
BEFORE = {"fleet": 10, "quota": 2, "rate": 2}


def policy() -> str:
    limiters = "".join(f"""\
  - name: {kind}-{i}
    {spec}
    consistency: batched
    sync_interval: 100ms
    failure_mode: closed
    applies_to: {{path_prefix: /{kind}-{i}/}}
""" for i in range(len(STALLS)) for kind, spec in KINDS.items())
    return f"version: 1\nidentity:\n  - header: x-api-key\nlimiters:\n{limiters}"


@contextmanager
def servers(path: Path, redis: RedisSingle, workdir: Path) -> Iterator[list[ServerProcess]]:
    args = ["--redis-url", redis.url, "--store-deadline-ms", "2000"]
    procs = [ServerProcess([path], args=[*args, "--metrics-listen", f"127.0.0.1:{free_port()}"],
                           workdir=workdir) for _ in range(REPLICAS)]
    try:
        with ThreadPoolExecutor(REPLICAS) as pool:  # start them at once
            list(pool.map(lambda p: p.start(), procs))
        yield procs
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def wait_fed(proc: ServerProcess) -> None:
    """Until ``proc`` no longer reads itself as starved (docs/limiters.md, "A starved server")."""
    deadline = time.monotonic() + 30
    while json.loads(get(f"http://127.0.0.1:{proc.admin_port}/status"))["overload"]["starved"]:
        assert time.monotonic() < deadline, "still starved 30 s after SIGCONT"
        time.sleep(0.05)


def test_batched_limits_hold_across_stalls_and_a_kill(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy())
    with servers(path, redis_single_clean, tmp_path) as procs:
        channels = [grpc.insecure_channel(f"127.0.0.1:{p.port}") for p in procs]
        stubs = [auth_pb2_grpc.AuthorizationStub(ch) for ch in channels]

        def send(replica: int, kind: str, phase: int) -> bool:
            req = check_request("sk_live_stall")
            req.attributes.request.http.path = f"/{kind}-{phase}/x"
            resp = stubs[replica].Check(req, timeout=10)
            if resp.status.code != 0:
                assert resp.denied_response.status.code == (503 if kind == "fleet" else 429)
            return resp.status.code == 0

        try:
            a = procs[0].proc
            assert a is not None
            for phase, stall in enumerate(STALLS):
                admitted = {kind: sum(send(0, kind, phase) for _ in range(n)) for kind, n in BEFORE.items()}
                assert admitted == BEFORE
                os.kill(a.pid, signal.SIGKILL if stall is None else signal.SIGSTOP)
                # B and C admit what they can while A stands still (1.5 s after a kill), at
                # least until they hold every fleet slot A does not (a slow machine: bounded)
                start = time.monotonic()
                deadline = start + (1.5 if stall is None else stall)
                while True:
                    for kind in KINDS:
                        for replica in (1, 2):
                            admitted[kind] += send(replica, kind, phase)
                    assert all(n <= LIMIT for n in admitted.values()), (stall, admitted)
                    now = time.monotonic()
                    if now >= deadline and (admitted["fleet"] == LIMIT or now - start > 30):
                        break
                assert admitted["fleet"] == LIMIT  # B and C took every slot A does not hold
                if stall is not None:  # A runs again: what it still holds admits nothing more
                    os.kill(a.pid, signal.SIGCONT)
                    for kind in KINDS:
                        admitted[kind] += sum(send(0, kind, phase) for _ in range(3))
                    # A saw its own stall as loop lag: starved for at most its check budget,
                    # its shedders refuse (overload) until then; the next phase needs it fed
                    wait_fed(procs[0])
                for kind in KINDS:  # nor does anything after A's renewals
                    admitted[kind] += sum(send(r, kind, phase) for r in (1, 2) for _ in range(3))
                assert all(n <= LIMIT for n in admitted.values()), (stall, admitted)
                with redis_single_clean.client() as raw:
                    (key,) = raw.scan_iter(f"extauthz:*:fl:fleet-{phase}:other")
                    assert raw.zcard(key) <= LIMIT
            for proc in procs[1:]:
                grants = json.loads(get(f"http://127.0.0.1:{proc.admin_port}/status"))["grants"]
                assert {name: g["overadmission"] for name, g in grants.items()} == dict.fromkeys(grants, 0)
                metrics = get(metrics_url(proc))
                assert 'extauthz_overadmission_total{limiter="fleet-0"} 0.0' in metrics
                assert 'extauthz_early_refusal_count{limiter="fleet-0"}' in metrics
        finally:
            for ch in channels:
                ch.close()
