"""Batched limiters across a replica that stands still (SIGSTOP, a starved loop, a crash),
on one injected clock: replicas are :class:`Engine` s on their own :class:`RedisStore`
clients of one real Redis (``check.lua`` running); a stalled replica runs neither checks nor
its timer while the clock moves, the others run their timers (``sync``) every period.

The guarantee (docs/limiters.md, "Stalls"): however long the stall, no more non-critical
requests are in flight than ``capacity`` (fleet_usage), and a bucket's grant is never spent
``sync_interval`` or more after the store yielded it (request_rate); a replica that stood
still past ``lease_ttl`` gets its in-flight requests counted again, and the leases counted
past ``capacity`` show as ``overadmission``. The same with real processes and SIGSTOP:
tests/integration/test_stalls.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Decision
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.fleet import FleetSlots, FleetUsageShedder
from extauthz.limiters.grants import GrantTable, Synced
from extauthz.limiters.request_rate import RequestRateLimiter
from testinfra.probes import release_and_wait
from testinfra.redis_servers import RedisSingle
from tests.store.conftest import make_redis_store
from tests.unit.helpers import get, policy_from

pytestmark = pytest.mark.redis

START = 7_000.25


def freeze(table: Synced, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica stands still: its timer (real time, here) runs no sync turn; the test
    runs them when the replica runs again."""
    table._stop_timer()
    monkeypatch.setattr(table, "_arm", lambda: None)
CAPACITY, BATCH = 30, 10
STALLS = (0.5, 1.5, 3.0)


def fleet_policy(tmp_path: Path) -> Any:
    return policy_from(tmp_path, {"limiters": [{
        "name": "fleet", "type": "fleet_usage", "capacity": CAPACITY, "reserved_for_critical": 0,
        "consistency": "batched", "batch": BATCH, "sync_interval": "100ms"}]})


def fleet_slots(engine: Engine) -> FleetSlots:
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, FleetUsageShedder) and lim.grants is not None
    return lim.grants


async def admit(engine: Engine, n: int) -> list[Decision]:
    """Up to ``n`` non-critical requests on ``engine``: those admitted (they stay in flight)."""
    out = []
    for _ in range(n):
        d = (await engine.check(get()))[1]
        if d.allowed:
            out.append(d)
    return out


async def run_others(clock: ManualClock, engines: list[Engine], seconds: float,
                     inflight: list[Decision], raw: Any, key: str) -> None:
    """``seconds`` of the clock in timer periods: the running replicas renew their grants and
    admit what they can; in flight (and the fleet's count) never above capacity."""
    period = fleet_slots(engines[0]).period
    steps = round(seconds / period)
    for _ in range(steps):
        clock.advance(period)
        for e in engines:
            await fleet_slots(e).sync()
            inflight.extend(await admit(e, 4))
            assert len(inflight) <= CAPACITY, f"{len(inflight)} in flight at t+{clock.now - START:.2f}"
            assert raw.zcard(key) <= CAPACITY


@pytest.mark.parametrize("stall", STALLS)
async def test_fleet_in_flight_never_above_capacity_across_a_stall(
        redis_single_clean: RedisSingle, tmp_path: Path, stall: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica A holds 10 requests in flight and stands still for 0.5, 1.5 or 3 s (the grant
    TTL is 1 s); B and C admit what they can meanwhile: never more than 30 in flight (before,
    A's members expired after the TTL and B and C admitted 30 more: 40)."""
    clock = ManualClock(START)
    policy = fleet_policy(tmp_path)
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(3)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    tables = [fleet_slots(e) for e in engines]
    raw = redis_single_clean.client()
    key = engines[0].snapshot.limiters[0].other_key  # type: ignore[attr-defined]
    try:
        inflight = await admit(engines[0], BATCH)
        assert len(inflight) == BATCH and tables[0].ttl == 1.0
        freeze(tables[0], monkeypatch)
        await run_others(clock, engines[1:], stall, inflight, raw, key)
        assert len(inflight) == CAPACITY  # B and C took every slot A does not hold
        # A runs again: its renewal finds its slots where it left them
        await tables[0].sync()
        assert raw.zcard(key) == CAPACITY
        assert not (await engines[0].check(get()))[1].allowed
        assert [t.status()["overadmission"] for t in tables] == [0, 0, 0]
    finally:
        for t in tables:
            t.close()
        for s in stores:
            await s.close()
        raw.close()


async def test_slots_in_use_that_the_store_lost_are_counted_again_as_overadmission(
        redis_single_clean: RedisSingle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store lost replica A's slots while its 10 requests are in flight (a Redis
    restarted without persistence; a stall cannot do it: the members outlive A's own leases)
    and B took them. A's next renewal restores the slots its requests hold: the fleet's count
    shows them (past capacity), every replica refuses until they finish, and the excess is
    counted as ``overadmission``, once per replica that sees it (the fleet's figure: the
    largest of the replicas')."""
    clock = ManualClock(START)
    policy = fleet_policy(tmp_path)
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(2)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    a, b = (fleet_slots(e) for e in engines)
    raw = redis_single_clean.client()
    key = engines[0].snapshot.limiters[0].other_key  # type: ignore[attr-defined]
    try:
        held = await admit(engines[0], BATCH)
        freeze(a, monkeypatch)  # A's next renewal is the test's
        raw.delete(key)
        clock.advance(a.period)
        await b.sync()
        taken = await admit(engines[1], CAPACITY)
        assert len(taken) == CAPACITY
        await a.sync()  # A runs again: its 10 requests are still in flight
        assert raw.zcard(key) == CAPACITY + BATCH
        assert a.status()["overadmission"] == BATCH
        assert not (await engines[1].check(get()))[1].allowed
        assert not (await engines[0].check(get()))[1].allowed
        await a.sync()  # counted once, not at every renewal
        assert a.status()["overadmission"] == BATCH
        await b.sync()  # B's renewal sees the same excess: each replica counts what it sees
        assert b.status()["overadmission"] == BATCH
        for d in held:  # A's requests finish: their slots go back at A's next turns
            await release_and_wait(engines[0].releaser, d.leases, d.lease_id, "access_log")
        for _ in range(4):
            clock.advance(a.period)
            await a.sync()
            await b.sync()
        assert raw.zcard(key) == CAPACITY
    finally:
        for t in (a, b):
            t.close()
        for s in stores:
            await s.close()
        raw.close()


# --------------------------------------------------------------------------- request_rate

RATE, BURST, RATE_BATCH = 10.0, 10.0, 5.0


def rate_table(engine: Engine) -> GrantTable:
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, RequestRateLimiter) and lim.grants is not None
    return lim.grants


@pytest.mark.parametrize("stall", STALLS)
async def test_a_grant_held_through_a_stall_is_not_spent_after_it(
        redis_single_clean: RedisSingle, tmp_path: Path, stall: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica A holds a grant (4 tokens unspent) and stands still for longer than
    ``sync_interval``, its timer with it; the bucket refills and B takes all of it. Spent
    after the stall, A's old tokens would admit 4 more at that instant than the exact
    limiter's ``burst``: A gives them back with its next grant op instead."""
    clock = ManualClock(START)
    policy = policy_from(tmp_path, {"limiters": [{
        "name": "rate", "type": "request_rate", "rate": RATE, "burst": BURST,
        "consistency": "batched", "batch": RATE_BATCH, "sync_interval": "100ms"}]})
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(2)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    tables = [rate_table(e) for e in engines]
    try:
        assert (await engines[0].check(get()))[1].allowed  # A: a grant of 5, 4 left
        assert tables[0].total() == RATE_BATCH - 1
        freeze(tables[0], monkeypatch)
        clock.advance(stall)  # A stands still; the bucket is full again
        # B takes everything the bucket yields now (nothing refills within this instant)
        admitted = sum([(await engines[1].check(get()))[1].allowed for _ in range(int(BURST) + 2)])
        assert admitted == BURST
        # A runs again, at the same instant: what the exact limiter admits now is spent
        late = sum([(await engines[0].check(get()))[1].allowed for _ in range(4)])
        assert admitted + late <= BURST
    finally:
        for t in tables:
            t.close()
        for s in stores:
            await s.close()
