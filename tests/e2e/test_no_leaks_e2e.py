"""No leaks: after 10,000 requests from 100 users through a real Envoy (some refused, some
aborted by the client), every in-flight count returns to zero, released by the access log
long before any lease TTL."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack
from testinfra.redis_servers import RedisSingle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUESTS = 10_000
USERS = 100
ABORTS = 200
THREADS = 8


def leak_policy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "identity": [{"header": "x-api-key"}],
        "limiters": [
            {"name": "user-rate", "type": "request_rate", "rate": 150, "burst": 120},
            {"name": "user-concurrency", "type": "concurrent_requests", "limit": 1, "lease_ttl": "60s"},
            {"name": "fleet", "type": "fleet_usage", "capacity": 120, "reserved_for_critical": 0.25},
            {"name": "workers", "type": "worker_utilization", "signal": {"source": "inflight", "capacity": 120},
             "sample_interval": "0.5s"},
        ],
    }))
    return directory


def drive(url: str) -> Counter[int]:
    """10,000 requests from 100 users on 8 threads (a few slow ones so that users overlap
    and some are refused) plus 200 client aborts mid-request."""
    statuses: Counter[int] = Counter()
    refused_by: Counter[str] = Counter()
    lock = threading.Lock()
    parts = urlsplit(url)

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        local: Counter[int] = Counter()
        by: Counter[str] = Counter()
        with HttpClient() as client:
            for _ in range(REQUESTS // THREADS + 1):
                user = f"sk_live_user{rnd.randrange(USERS)}"
                path = "/v1/slow?delay=0.05" if rnd.random() < 0.3 else "/v1/fast"
                method = "POST" if rnd.random() < 0.2 else "GET"
                res = client.send(url + path, method, {"x-api-key": user})
                local[res.status] += 1
                if res.limiter:
                    by[res.limiter] += 1
        with lock:
            statuses.update(local)
            refused_by.update(by)

    def aborter(seed: int) -> None:
        rnd = random.Random(1000 + seed)
        for _ in range(ABORTS // 4):
            user = f"sk_live_user{rnd.randrange(USERS)}"
            with socket.create_connection((parts.hostname, parts.port)) as s:
                s.sendall(f"GET /v1/slow?delay=0.5 HTTP/1.1\r\nHost: x\r\nx-api-key: {user}\r\n\r\n".encode())
                time.sleep(0.1)  # admitted and in flight at the upstream, then abandoned

    with ThreadPoolExecutor(THREADS + 4) as pool:
        jobs = [pool.submit(worker, i) for i in range(THREADS)] + [pool.submit(aborter, i) for i in range(4)]
        for job in jobs:
            job.result()
    print("refused by", refused_by)
    return statuses


def live_leases_in_redis(client: redis.Redis) -> dict[str, int]:
    now = float(client.time()[0])
    counts = {}
    for key in client.scan_iter(match="extauthz:*"):
        if client.type(key) == b"zset":
            counts[key.decode()] = int(client.zcount(key, now, "+inf"))
    return counts


def test_no_leaks_on_redis(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    r = redis_single_clean.client()
    with Stack([leak_policy(tmp_path / "p")], server_args=["--redis-url", redis_single_clean.url]) as stack:
        statuses = drive(stack.url)
        assert sum(statuses.values()) >= REQUESTS
        assert statuses[200] > REQUESTS // 2 and statuses[429] > 50, statuses  # some refused
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(live_leases_in_redis(r).values()):
            time.sleep(0.1)
        leases = live_leases_in_redis(r)
        assert not any(leases.values()), {k: v for k, v in leases.items() if v}


def live_leases_in_memory(stack: Stack) -> dict[str, int]:
    assert stack.server is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.server.admin_port}/status", timeout=5) as resp:
        status = json.load(resp)
    leases: dict[str, int] = status["store"]["live_leases"]
    return leases


def test_no_leaks_on_the_embedded_store(tmp_path: Path) -> None:
    with Stack([leak_policy(tmp_path / "p")]) as stack:
        statuses = drive(stack.url)
        assert sum(statuses.values()) >= REQUESTS
        assert statuses[200] > REQUESTS // 2 and statuses[429] > 50, statuses
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and live_leases_in_memory(stack):
            time.sleep(0.1)
        assert live_leases_in_memory(stack) == {}
