"""The fleet limiter counts a request Envoy let through unchecked while it is in flight, from
its first periodic access-log entry (``access_log_flush_interval``, the shipped configs: 1 s)
to its last: another non-critical request is refused while it holds the fleet's only
non-critical slot, and admitted once it ended. Through a real Envoy (envoy/envoy.yaml)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extauthz.devtools.client import HttpClient
from extauthz.devtools.stack import Stack

from .waits import live_leases, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLICY = """\
version: 1
identity: [{header: x-api-key}]
limiters:
  - {name: fleet, type: fleet_usage, capacity: 2, reserved_for_critical: 0.5, lease_ttl: 30s}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d: Path = tmp_path_factory.mktemp("unchecked-fleet")
    (d / "policy.yaml").write_text(POLICY)
    with Stack([d]) as s:
        yield s


def status(stack: Stack) -> dict[str, Any]:
    assert stack.server is not None
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{stack.server.admin_port}/status", timeout=10) as resp:
        data: dict[str, Any] = json.load(resp)
    return data


#: how long the unchecked request stays in flight: long enough for its first periodic entry
#: (about 1 s after its start), the server's recovery from the stop and the refused request on
#: a slow, shared machine; each wait below is bounded well within it
SLOW_SECONDS = 10


def test_an_unchecked_request_holds_a_fleet_slot_while_in_flight(stack: Stack, client: HttpClient) -> None:
    assert stack.server is not None and stack.server.proc is not None and stack.upstream is not None
    key = {"x-api-key": "sk_live_u"}
    statuses: list[int] = []

    def slow() -> None:
        with HttpClient(timeout=60) as c:
            statuses.append(c.send(stack.url + f"/v1/slow?delay={SLOW_SECONDS}", headers=key).status)

    pid = stack.server.proc.pid
    os.kill(pid, signal.SIGSTOP)  # its check outlasts Envoy's timeout: it passes unchecked
    sender = threading.Thread(target=slow)
    try:
        sender.start()
        wait_for(lambda: stack.upstream is not None and stack.upstream.inflight == 1)
    finally:
        os.kill(pid, signal.SIGCONT)
    # its periodic entry arrives: the fleet counts it, and the only non-critical slot is taken
    wait_for(lambda: sum(live_leases(stack.server).values()) == 1)
    assert status(stack)["unchecked_requests"]["fleet"] == {"in_flight": 1, "counted": 1, "errors": 0}
    # the server refuses non-critical checks as `overload` while it reads itself starved after
    # the stop (at most one check budget): the refusal below must be the fleet limiter's
    wait_for(lambda: not status(stack)["overload"]["starved"])
    refused = client.send(stack.url + "/v1/x", headers=key)
    assert refused.status == 503, refused.body
    problem = json.loads(refused.body)
    assert problem["limiter"] == "fleet" and problem["type"].endswith(":fleet_capacity_reserved"), problem
    assert not statuses and stack.upstream.inflight == 1  # refused while the unchecked one was in flight
    sender.join(60)
    assert statuses == [200]
    wait_for(lambda: not live_leases(stack.server))  # its last entry gave the slot back
    assert status(stack)["unchecked_requests"]["fleet"]["in_flight"] == 0
    assert client.send(stack.url + "/v1/x", headers=key).status == 200
