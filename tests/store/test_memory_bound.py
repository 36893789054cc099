"""The embedded store holds at most ``max_keys`` per-user keys per limiter (``serve
--memory-max-keys``), on an injected clock: past it the least recently used key is forgotten
and counted; a lease set with a request in flight is never the one; quota counts are
forgotten after their window. Without the bound a monthly quota keyed on a free header grew
by about 260 bytes per new key until the month's end (bench/memory_per_key.py)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from bench.memory_per_key import KINDS, grow, store_for
from extauthz.core.clock import ManualClock
from extauthz.store.base import BucketOp, CountOp, LeaseOp
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from testinfra.probes import key_count
from tests.observe.helpers import admin, running, samples, scrape, value, write_policy

K = Keys("t")
MONTH = 31 * 86400


def quota(who: str, limit: int = 2, name: str = "monthly") -> CountOp:
    return CountOp(K.quota(name, who, 1764547200), limit=limit, cost=1, ttl=MONTH, reset=MONTH)


def lease(who: str, limit: int = 1) -> LeaseOp:
    return LeaseOp(K.user_leases("conc", who), limit=limit, ttl=60)


def test_a_limiter_holds_at_most_max_keys_and_counts_what_it_forgets() -> None:
    store = MemoryStore(ManualClock(), max_keys=100)
    for i in range(1_000):  # one new API key per request, as a client making keys up does
        assert store.check_now([quota(f"k{i}")], f"r{i}").admitted
    assert store.held() == {"monthly": 100}
    assert key_count(store) == 100
    assert store.evictions == {"monthly": 900}
    # the most recent keys kept their counts; a forgotten one starts its window from 0
    assert store.check_now([quota("k999")], "again").results[0].remaining == 0
    assert store.check_now([quota("k0")], "back").results[0].remaining == 1
    assert store.evictions == {"monthly": 901}


def test_the_least_recently_used_key_goes_first_refused_requests_count_as_use() -> None:
    store = MemoryStore(ManualClock(), max_keys=2)
    for _ in range(2):
        store.check_now([quota("spent")], "s")
    store.check_now([quota("idle")], "i")
    assert not store.check_now([quota("spent")], "s3").admitted  # refused: still its most recent use
    store.check_now([quota("new")], "n")  # over the bound: "idle" is the least recently used
    assert store.evictions == {"monthly": 1}
    assert not store.check_now([quota("spent")], "s4").admitted  # not forgiven
    assert store.check_now([quota("idle")], "i2").results[0].remaining == 1  # forgotten: from 0


def test_a_spent_quota_outlives_a_flood_of_made_up_keys() -> None:
    """A client whose quota is spent sends 100 times the bound in made-up keys (each asking
    once), waits, and asks again: still refused (its count was the least recently used and
    was forgotten: the quota given back). The bound holds; the made-up keys went."""
    clock = ManualClock()
    store = MemoryStore(clock, max_keys=100)
    for i in range(2):
        assert store.check_now([quota("spent")], f"s{i}").admitted
    store.check_now([quota("half")], "h")  # a real user, 1 of 2 used, idle since
    assert not store.check_now([quota("spent")], "s2").admitted
    clock.advance(60)
    for i in range(10_000):
        clock.advance(0.01)
        assert store.check_now([quota(f"made-up-{i}")], f"m{i}").admitted
    clock.advance(3600)
    assert not store.check_now([quota("spent")], "s3").admitted  # not forgiven
    assert store.held() == {"monthly": 100}
    assert store.evictions == {"monthly": 2 + 10_000 - 100}  # every key but "spent" and the last 99
    # what still goes: a count under its limit ("half" starts again from 0)
    assert store.check_now([quota("half")], "h2").results[0].remaining == 1


def test_spent_counts_alone_still_keep_the_bound() -> None:
    """Made-up keys that each spend their quota (limit 1: one request each) are all worth
    keeping; past the EVICT_TRIES looked at, the least recently used spent one goes: the
    table never grows past its bound (that flood can push a spent count out: docs/security.md)."""
    store = MemoryStore(ManualClock(), max_keys=10)
    for i in range(1_000):
        assert store.check_now([quota(f"k{i}", limit=1)], f"r{i}").admitted
        assert store.held()["monthly"] <= 10
    assert store.held() == {"monthly": 10} and key_count(store) == 10
    assert store.evictions == {"monthly": 990}


def test_each_limiter_has_its_own_bound() -> None:
    store = MemoryStore(ManualClock(), max_keys=3)
    for i in range(5):
        store.check_now([quota(f"k{i}"), BucketOp(K.bucket("rate", f"k{i}"), rate=1, burst=5, cost=1)], f"r{i}")
    assert store.held() == {"monthly": 3, "rate": 3}
    assert store.evictions == {"monthly": 2, "rate": 2}


def test_a_lease_set_with_a_request_in_flight_is_kept() -> None:
    """Forgetting it would let that user past their concurrency limit: the table goes over
    its bound by the requests in flight instead, and idle state goes first."""
    clock = ManualClock()
    store = MemoryStore(clock, max_keys=2)
    for who in ("a", "b", "c"):
        assert store.check_now([lease(who)], f"{who}1").admitted
    assert store.held() == {"conc": 3} and store.evictions == {}
    assert not store.check_now([lease("a")], "a2").admitted  # still at its limit of 1
    store.release_now([lease("b").key], "b1")  # b's request finished: its set is gone
    assert store.held() == {"conc": 2}
    clock.advance(61)  # a's and c's leases expire unreleased (no access log came)
    assert store.check_now([lease("d")], "d1").admitted
    assert store.check_now([lease("e")], "e1").admitted
    assert store.live_leases() == {lease("d").key: 1, lease("e").key: 1}
    assert store.held() == {"conc": 2} and store.evictions == {}  # expired, not evicted


def test_a_quota_count_is_forgotten_after_its_window() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    for i in range(50):
        store.check_now([CountOp(K.quota("hourly", f"k{i}", 0), limit=5, cost=1, ttl=3600, reset=3600)], f"r{i}")
    assert key_count(store) == 50
    clock.advance(3601)
    for j in range(3):  # the sweep's share of a few checks
        store.check_now([BucketOp(K.bucket("rate", "hot"), rate=1, burst=5, cost=1)], f"h{j}")
    assert key_count(store) == 1  # the hot bucket: every count of the past window went


async def test_the_server_bounds_its_limiters_and_shows_what_it_forgot(tmp_path: Path) -> None:
    """``--memory-max-keys`` through a real server: a monthly quota keyed on the API key, 5
    made-up keys against a bound of 3; ``/status`` (store.keys, store.evictions) and
    ``extauthz_store_evictions_total{limiter}`` show the 2 forgotten."""
    policy = write_policy(tmp_path / "p" / "api.yaml", [
        {"name": "monthly", "type": "quota", "limit": 10, "period": "month"}])
    async with running([policy.parent], memory_max_keys=3) as (server, client):
        assert [await client.check(f"sk_live_{i}") for i in range(5)] == [200] * 5
        _, status = await admin(server, "GET", "/status")
        assert status["store"]["max_keys_per_limiter"] == 3
        assert status["store"]["keys"] == {"monthly": 3}
        assert status["store"]["evictions"] == {"monthly": 2}
        assert value(samples(await scrape(server)), "extauthz_store_evictions_total", limiter="monthly") == 2


@pytest.mark.slow
def test_the_memory_held_stays_flat_past_the_bound() -> None:
    """bench/memory_per_key.py's measure (tracemalloc: the state, its key string, the
    bookkeeping): past the bound new keys cost nothing kept; without it a monthly quota kept
    about 260 B per new key, a bucket about 400 B."""
    n = 1_000
    tracemalloc.start()
    try:
        for kind in ("quota (monthly)", "request_rate"):
            store = store_for(n)
            assert grow(store, KINDS[kind], 0, n) > 200 * n  # the figures docs/limiters.md gives
            grow(store, KINDS[kind], n, 4 * n)  # the tables reach their size
            assert grow(store, KINDS[kind], 5 * n, 4 * n) < 4 * n, kind  # under 1 B per new key
            assert key_count(store) == n
    finally:
        tracemalloc.stop()
