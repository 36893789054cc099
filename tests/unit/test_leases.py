"""The request-id index (issue 20 defects 2 and 8): bounded per id and in all, entries expire
after the longest lease TTL (injected clock), and an entry without our metadata releases only
the request its check saw, never one of several under a reused id."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.clock import ManualClock
from extauthz.proto import accesslog_data_pb2, core_pb2
from extauthz.server.leases import LeaseIndex, seen_as, seen_at
from extauthz.server.services import entry_seen

from .helpers import policy_from


def index(clock: ManualClock, *, retention: float = 60.0, **bounds: int) -> LeaseIndex:
    return LeaseIndex(clock=clock, retention=lambda: retention, **bounds)


def test_a_bare_entry_takes_only_the_request_its_check_saw() -> None:
    idx = index(ManualClock())
    idx.put("rid", ("k",), "a", seen_at(1_000))
    assert idx.take("rid", None, (seen_at(1_001), seen_as("GET", "/healthz"))) is None  # another request
    assert idx.take("rid", None, ()) is None
    assert idx.take("rid", None, (seen_at(1_000),)) == (("k",), "a")
    assert len(idx) == 0


def test_a_reused_request_id_identifies_no_request() -> None:
    """Before the fix, an entry without metadata popped the oldest lease under its id."""
    idx = index(ManualClock())
    idx.put("rid", ("k",), "a", seen_as("GET", "/v1/x"))
    idx.put("rid", ("k",), "b", seen_as("GET", "/v1/x"))
    assert idx.take("rid", None, (seen_as("GET", "/v1/x"),)) is None
    assert idx.take("rid", "b") == (("k",), "b")  # by lease id (our metadata): exactly that one
    # still two checks saw the id: the one left is not released by a bare entry either
    assert idx.take("rid", None, (seen_as("GET", "/v1/x"),)) is None
    assert idx.take("rid", "a") == (("k",), "a") and len(idx) == 0


def test_a_bound_per_request_id_and_in_all() -> None:
    idx = index(ManualClock(), limit=10, per_id=3)
    for i in range(1000):  # one reused id
        idx.put("same", ("k",), f"{i:016x}", seen_at(i))
    assert len(idx) == 3 and idx.status()["request_ids"] == 1
    assert idx.take("same", f"{999:016x}") is not None and idx.take("same", f"{0:016x}") is None
    for i in range(20):
        idx.put(f"rid-{i}", ("k",), "a", seen_at(i))
    status = idx.status()
    assert status["entries"] == len(idx) == 10 and status["evicted"] == 997 + 12
    assert idx.take("rid-9", "a") is None and idx.take("rid-10", "a") is not None  # the oldest went first


def test_entries_expire_after_the_longest_lease_ttl() -> None:
    clock = ManualClock()
    ttl = [30.0]
    idx = LeaseIndex(clock=clock, retention=lambda: ttl[0])
    idx.put("old", ("k",), "a", seen_at(1))
    clock.advance(20)
    idx.put("new", ("k",), "b", seen_at(2))
    clock.advance(9.9)
    assert idx.status()["entries"] == 2
    clock.advance(0.1)  # "old" is 30 s old: its lease has expired in the store too
    assert idx.status() == {"entries": 1, "request_ids": 1, "expired": 1, "evicted": 0}
    assert idx.take("old", None, (seen_at(1),)) is None
    ttl[0] = 5.0  # a reload shortened the longest lease TTL
    assert idx.status()["entries"] == 0 and idx.status()["expired"] == 2


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        LeaseIndex(per_id=0)


def test_what_an_access_log_entry_says_of_its_request() -> None:
    entry = accesslog_data_pb2.HTTPAccessLogEntry()
    entry.common_properties.start_time.FromMicroseconds(1_795_000_000_123_456)
    entry.request.request_method = core_pb2.POST
    entry.request.path = "/v2/customers?x=1"
    entry.request.original_path = "/v1/customers"
    assert entry_seen(entry) == (seen_at(1_795_000_000_123_456), seen_as("POST", "/v2/customers"),
                                 seen_as("POST", "/v1/customers"))


def test_the_longest_lease_ttl_of_a_policy(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, {"limiters": [
        {"name": "rate", "type": "request_rate", "rate": 1, "burst": 1},
        {"name": "conc", "type": "concurrent_requests", "limit": 2, "lease_ttl": "90s"},
        {"name": "fleet", "type": "fleet_usage", "capacity": 9, "lease_ttl": "30s"}]})
    assert policy.longest_lease_ttl == 90.0
    assert policy_from(tmp_path, {"limiters": [
        {"name": "rate", "type": "request_rate", "rate": 1, "burst": 1}]}).longest_lease_ttl == 0.0
