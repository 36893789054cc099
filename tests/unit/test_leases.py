"""The server's side of the lease loop (server/leases.py). The request-id index (issue 20
defects 2 and 8): bounded per id and in all, entries expire after the longest lease TTL
(injected clock), and an entry without our metadata releases only the request its check saw,
never one of several under a reused id. The lease owner: what it remembers of an admitted
check, how it vets and matches an access-log entry, and what it hands to the releaser."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.context import RequestContext
from extauthz.engine.tickets import BAD_TICKET, MALFORMED, NO_TICKET
from extauthz.proto import accesslog_data_pb2, core_pb2
from extauthz.server.leases import LeaseIndex, Leases, seen_as, seen_at
from extauthz.server.services import entry_seen

from .helpers import engine_for, get, policy_from


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


def admitted(tmp_path: Path, request_id: str = "rid") -> tuple[Leases, RequestContext, tuple[str, ...], str, str]:
    """A lease owner on the embedded store and one check it admitted with a lease."""
    policy = policy_from(tmp_path, {"limiters": [
        {"name": "conc", "type": "concurrent_requests", "limit": 2, "lease_ttl": "60s"}]})
    engine, _ = engine_for(policy, ManualClock())
    leases = Leases(engine)
    ctx = engine.context(get(request_id=request_id))
    decision = asyncio.run(engine.decide(ctx))
    assert decision.leases
    ticket = leases.admitted(ctx, decision, seen_as("GET", "/v1/customers"))
    return leases, ctx, decision.leases, decision.lease_id, ticket


def test_an_entry_with_our_metadata_releases_its_leases_and_forgets_the_index_entry(tmp_path: Path) -> None:
    leases, _, keys, lease_id, ticket = admitted(tmp_path)
    lease = (list(keys), lease_id)
    assert leases.refused(lease, ticket, True) is None
    found = leases.finished("rid", lease, unauthorized=False, seen=lambda: pytest.fail("not asked"))
    assert found == (list(keys), lease_id, "access_log")
    assert len(leases.index) == 0
    assert leases.release(*found) is None  # the embedded store: released at once
    assert leases.releaser.count("access_log", "released") == 1 and leases.releaser.leases_released == 1


def test_an_entry_without_metadata_finds_only_the_request_its_check_saw(tmp_path: Path) -> None:
    leases, _, keys, lease_id, _ = admitted(tmp_path)
    assert leases.finished("rid", None, unauthorized=False, seen=lambda: (seen_as("GET", "/other"),)) is None
    assert leases.finished("other", None, unauthorized=False, seen=lambda: (seen_as("GET", "/v1/customers"),)) is None
    assert leases.finished("rid", None, unauthorized=False,
                           seen=lambda: (seen_as("GET", "/v1/customers"),)) == (keys, lease_id, "request_id_index")


def test_an_entry_of_a_refused_request_takes_nothing_from_the_index(tmp_path: Path) -> None:
    leases, _, _, _, _ = admitted(tmp_path)
    assert leases.finished("rid", None, unauthorized=True, seen=lambda: (seen_as("GET", "/v1/customers"),)) is None
    assert len(leases.index) == 1


def test_lease_metadata_is_vetted_before_anything_acts_on_it(tmp_path: Path) -> None:
    leases, _, keys, lease_id, ticket = admitted(tmp_path)
    lease = (list(keys), lease_id)
    assert leases.refused(lease, "", True) == NO_TICKET
    assert leases.refused(lease, ticket[:-2] + ("aa" if not ticket.endswith("aa") else "bb"), True) == BAD_TICKET
    assert leases.refused(None, "", True) == MALFORMED  # our fields, not as a check writes them
    assert leases.refused(None, "", False) is None  # not ours at all: only the request id may match


def test_an_abandoned_answer_gives_its_leases_back_at_once(tmp_path: Path) -> None:
    leases, ctx, _, _, _ = admitted(tmp_path, request_id="")
    assert len(leases.index) == 0  # no request id: nothing to index
    decision = asyncio.run(leases.engine.decide(ctx))
    leases.abandoned(decision)
    assert leases.releaser.count("cancelled_check", "released") == 1
