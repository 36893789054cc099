"""The "request finished" signal through a real Envoy: leases released by Envoy's gRPC
access log (not by the TTL), client aborts, and the TTL backstop when the log is cut."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

pytestmark = pytest.mark.e2e

LIMIT = 3
LEASE_TTL = 2.0


def write_policy(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(yaml.safe_dump({
        "version": 1,
        "identity": [{"header": "x-api-key"}],
        "limiters": [{"name": "user-concurrency", "type": "concurrent_requests",
                      "limit": LIMIT, "lease_ttl": f"{LEASE_TTL}s"}],
    }))
    return directory


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, grpc_server_kind: str) -> Iterator[Stack]:
    with Stack([write_policy(tmp_path_factory.mktemp("release"))],
               server_args=["--grpc-server", grpc_server_kind]) as s:
        yield s


def live_leases(stack: Stack) -> dict[str, int]:
    """The embedded store's live leases per key (the server's admin ``/status``)."""
    assert stack.server is not None
    url = f"http://127.0.0.1:{stack.server.admin_port}/status"
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5) as resp:
        leases: dict[str, int] = json.load(resp)["store"]["live_leases"]
    return leases


def user(name: str) -> dict[str, str]:
    return {"x-api-key": f"sk_live_{name}"}


def wait_until_admitted(client: HttpClient, url: str, headers: dict[str, str], timeout: float) -> float:
    """Seconds until a request is admitted (polling every 10 ms)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if client.send(url, headers=headers).status == 200:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"not admitted within {timeout} s")


def test_exactly_limit_reach_upstream_then_release_by_access_log(client: HttpClient, stack: Stack) -> None:
    assert stack.upstream is not None
    stack.upstream.reset()
    n = 8
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: client.send(stack.url + "/v1/slow?delay=1", headers=user("k")), range(n)))
    finished = time.monotonic()
    assert sorted(r.status for r in results) == [200] * LIMIT + [429] * (n - LIMIT)
    assert stack.upstream.served == LIMIT and stack.upstream.max_inflight == LIMIT
    refused = next(r for r in results if r.status == 429)
    assert refused.limiter == "user-concurrency"
    assert refused.headers["ratelimit-policy"] == f'"user-concurrency";q={LIMIT};qu="concurrent-requests"'
    # Released by the access log a few ms after each response, far before lease_ttl (2 s).
    waited = wait_until_admitted(client, stack.url + "/v1/x", user("k"), timeout=LEASE_TTL)
    assert time.monotonic() - finished < 0.5, f"admitted again only after {waited:.3f} s"
    # and the full limit is free again once that request's own entry arrived (the shipped
    # configs send the access log every 5 ms), still well before lease_ttl
    while live_leases(stack) and time.monotonic() - finished < LEASE_TTL / 2:
        time.sleep(0.005)
    assert not live_leases(stack)
    with ThreadPoolExecutor(LIMIT) as pool:
        again = list(pool.map(lambda _: client.send(stack.url + "/v1/slow?delay=0.3", headers=user("k")), range(LIMIT)))
    assert [r.status for r in again] == [200] * LIMIT


def open_slow_request(url: str, key: str, delay: float) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(f"GET /v1/slow?delay={delay} HTTP/1.1\r\nHost: x\r\nx-api-key: {key}\r\n\r\n".encode())
    return sock


def test_client_abort_frees_its_slot(client: HttpClient, stack: Stack) -> None:
    key = "sk_live_abort"
    socks = [open_slow_request(stack.url, key, delay=5) for _ in range(LIMIT)]
    try:
        time.sleep(0.3)  # all three admitted and in flight at the upstream
        assert client.send(stack.url + "/v1/x", headers={"x-api-key": key}).status == 429
        socks[0].close()  # the client gives up: Envoy logs the aborted request
        waited = wait_until_admitted(client, stack.url + "/v1/x", {"x-api-key": key}, timeout=LEASE_TTL)
        assert waited < 0.5, f"abort released only after {waited:.3f} s"
    finally:
        for s in socks:
            s.close()


def test_leases_expire_at_ttl_when_the_access_log_is_cut(client: HttpClient, tmp_path: Path) -> None:
    with Stack([write_policy(tmp_path / "p")], access_log="never") as cut:
        for _ in range(LIMIT):
            assert client.send(cut.url + "/v1/x", headers=user("cut")).status == 200
        finished = time.monotonic()
        assert client.send(cut.url + "/v1/x", headers=user("cut")).status == 429  # nobody released
        wait_until_admitted(client, cut.url + "/v1/x", user("cut"), timeout=LEASE_TTL + 3)
        waited = time.monotonic() - finished
        assert LEASE_TTL - 0.3 <= waited <= LEASE_TTL + 1.0, waited
