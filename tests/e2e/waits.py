"""What several e2e tests wait for: a condition (polled; the bound only ends a stuck test, it is
not a timing assertion), a server's live leases, and one slow request held in flight; and the
gateway tests' small limits."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import ServerProcess

T = TypeVar("T")

#: the gateway tests' limiters, small enough to reach: 3 requests per user on /rate, and a
#: fleet of 2 on /v1/ with one slot reserved for critical (one non-critical request fills it)
GATEWAY_LIMITERS = """\
limiters:
  - {name: user-rate, type: request_rate, rate: 0.001, burst: 3, applies_to: {path_prefix: /rate}}
  - {name: fleet, type: fleet_usage, capacity: 2, reserved_for_critical: 0.5, applies_to: {path_prefix: /v1/}}
"""
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def wait_for(predicate: Callable[[], T], timeout: float = 15.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.05)


def live_leases(server: ServerProcess) -> dict[str, int]:
    """Live leases per lease key on a server with the embedded store (admin ``/status``)."""
    with _OPENER.open(f"http://127.0.0.1:{server.admin_port}/status", timeout=5) as resp:
        leases: dict[str, int] = json.load(resp)["store"]["live_leases"]
    return leases


@contextmanager
def held_request(url: str, headers: dict[str, str], server: ServerProcess) -> Iterator[Future[Any]]:
    """Send one request the upstream answers after ``delay`` (in ``url``); yield once its lease
    is held, with the future of its status."""
    started = threading.Event()

    def send() -> int:
        with HttpClient(timeout=30) as c:
            started.set()
            return c.send(url, headers=headers).status

    with ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(send)
        started.wait(5)
        wait_for(lambda: sum(live_leases(server).values()) >= 1)
        yield held
