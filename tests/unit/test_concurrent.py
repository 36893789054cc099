"""Concurrent requests limiter and fleet usage shedder on an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Decision
from testinfra.probes import release_and_wait

from .helpers import engine_for, get, policy_from

CONC = {"name": "user-concurrency", "type": "concurrent_requests", "limit": 100, "lease_ttl": "60s"}
FLEET = {"name": "fleet", "type": "fleet_usage", "capacity": 10, "reserved_for_critical": 0.2}


async def test_seed_gist_concurrency_case(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [CONC]}), clock)
    for _ in range(1001):  # check, finish, release: never more than one in flight
        _, d = await engine.check(get())
        assert d.allowed and len(d.leases) == 1
        assert await release_and_wait(engine.releaser, d.leases, d.lease_id, "access_log") == 1
    held: list[Decision] = []
    for _ in range(100):
        _, d = await engine.check(get())
        assert d.allowed
        held.append(d)
    _, d = await engine.check(get())
    assert not d.allowed and d.http_status == 429
    assert d.denied_by is not None and d.denied_by.limiter == "user-concurrency"
    assert d.denied_by.reason == "concurrency_exceeded" and d.leases == ()
    # one release frees one slot
    await release_and_wait(engine.releaser, held[0].leases, held[0].lease_id, "access_log")
    _, d = await engine.check(get())
    assert d.allowed


async def test_release_is_idempotent(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [dict(CONC, limit=1)]}), clock)
    _, d = await engine.check(get())
    assert await release_and_wait(engine.releaser, d.leases, d.lease_id, "access_log") == 1
    assert await release_and_wait(engine.releaser, d.leases, d.lease_id, "access_log") == 0
    _, d2 = await engine.check(get())
    assert d2.allowed
    # an old id never frees a new lease
    assert await release_and_wait(engine.releaser, d.leases, d.lease_id, "access_log") == 0
    _, d3 = await engine.check(get())
    assert not d3.allowed


async def test_lost_leases_expire_at_lease_ttl(tmp_path: Path, clock: ManualClock) -> None:
    engine, store = engine_for(policy_from(tmp_path, {"limiters": [dict(CONC, limit=2, lease_ttl="5s")]}), clock)
    for _ in range(2):
        assert (await engine.check(get()))[1].allowed
    assert not (await engine.check(get()))[1].allowed
    clock.advance(4.9)
    assert not (await engine.check(get()))[1].allowed
    clock.advance(0.2)  # both leases are now older than lease_ttl: swept in the check
    assert (await engine.check(get()))[1].allowed
    key = engine.keys.user_leases("user-concurrency", engine.context(get()).identity)
    assert await store.inflight([key]) == [1]


async def test_fleet_keeps_capacity_for_critical(tmp_path: Path, clock: ManualClock) -> None:
    policy = policy_from(tmp_path, {
        "limiters": [FLEET],
        "classification": {"rules": [{"match": {"path_prefix": "/v1/charges"}, "tier": "critical"}]},
    })
    engine, _ = engine_for(policy, clock)
    for i in range(8):  # non-critical traffic gets (1 - 0.2) * 10 = 8 slots
        _, d = await engine.check(get(key=f"sk_live_{i}"))
        assert d.allowed
    _, d = await engine.check(get(key="sk_live_9"))
    assert not d.allowed and d.http_status == 503
    assert d.denied_by is not None and d.denied_by.limiter == "fleet"
    assert d.denied_by.reason == "fleet_capacity_reserved"
    for i in range(5):  # critical requests are counted, never refused by this shedder
        _, c = await engine.check(get("/v1/charges", key=f"sk_live_c{i}", method="POST"))
        assert c.allowed and c.tier.value == "critical" and len(c.leases) == 1
    shedder = engine.snapshot.limiters[0]
    assert await engine.store.inflight(list(shedder.lease_keys)) == [5, 8]  # type: ignore[attr-defined]


async def test_refused_request_holds_no_lease(tmp_path: Path, clock: ManualClock) -> None:
    rate = {"name": "user-rate", "type": "request_rate", "rate": 1, "burst": 1}
    engine, store = engine_for(policy_from(tmp_path, {"limiters": [dict(CONC, limit=5), rate, FLEET]}), clock)
    assert (await engine.check(get()))[1].allowed
    _, d = await engine.check(get())
    assert not d.allowed and d.denied_by is not None and d.denied_by.limiter == "user-rate"
    ident = engine.context(get()).identity
    fleet = engine.snapshot.limiters[2]
    counts = await store.inflight([engine.keys.user_leases("user-concurrency", ident),
                                   *fleet.lease_keys])  # type: ignore[attr-defined]
    assert counts == [1, 0, 1]


@pytest.mark.parametrize("mode", ["shadow", "off"])
async def test_shadow_or_off_concurrency_never_blocks(tmp_path: Path, clock: ManualClock, mode: str) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [dict(CONC, limit=1, mode=mode)]}), clock)
    for _ in range(3):
        assert (await engine.check(get()))[1].allowed
