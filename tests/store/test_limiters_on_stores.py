"""The seed's limiter cases through the engine on every store (embedded, single Redis,
Redis Cluster, Sentinel): the same behaviour whatever holds the state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from extauthz.engine import Engine
from extauthz.sampler import sample_once
from extauthz.verdict import Decision

from ..unit.helpers import get, policy_from
from .conftest import StoreCase


def engine(case: StoreCase, tmp_path: Path, limiters: list[dict[str, object]]) -> Engine:
    policy = policy_from(tmp_path, {"limiters": limiters,
                                    "classification": {"rules": [
                                        {"match": {"path_prefix": "/v1/charges"}, "tier": "critical"}]}})
    return Engine(case.store, policy, clock=case.clock, deadline=1.0, rng=random.Random(7))


async def test_token_bucket_seed_case(store_case: StoreCase, tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [{"name": "user-rate", "type": "request_rate", "rate": 100, "burst": 500}])
    assert sum([(await e.check(get()))[1].allowed for _ in range(501)]) == 500
    store_case.clock.advance(1.0)
    assert sum([(await e.check(get()))[1].allowed for _ in range(101)]) == 100


async def test_concurrency_seed_case(store_case: StoreCase, tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [{"name": "conc", "type": "concurrent_requests", "limit": 100}])
    for _ in range(1001):
        _, d = await e.check(get())
        assert d.allowed
        assert await e.releaser.release_and_wait(d.leases, d.lease_id, "access_log") == 1
    held: list[Decision] = []
    for _ in range(100):
        _, d = await e.check(get())
        assert d.allowed
        held.append(d)
    _, d = await e.check(get())
    assert not d.allowed and d.http_status == 429 and d.denied_by is not None
    assert d.denied_by.limiter == "conc" and d.leases == ()


async def test_fleet_case(store_case: StoreCase, tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [{"name": "fleet", "type": "fleet_usage", "capacity": 10,
                                       "reserved_for_critical": 0.2}])
    for i in range(8):
        assert (await e.check(get(key=f"sk_live_{i}")))[1].allowed
    _, d = await e.check(get(key="sk_live_9"))
    assert not d.allowed and d.http_status == 503
    for i in range(3):
        _, c = await e.check(get("/v1/charges", key=f"sk_live_c{i}", method="POST"))
        assert c.allowed


async def test_refused_request_holds_nothing_anywhere(store_case: StoreCase, tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [
        {"name": "conc", "type": "concurrent_requests", "limit": 5},
        {"name": "fleet", "type": "fleet_usage", "capacity": 100},
        {"name": "user-rate", "type": "request_rate", "rate": 1, "burst": 1},
    ])
    assert (await e.check(get()))[1].allowed
    _, d = await e.check(get())
    assert not d.allowed and d.denied_by is not None and d.denied_by.limiter == "user-rate"
    ident = e.context(get()).identity
    fleet_keys = e.snapshot.limiters[1].lease_keys  # type: ignore[attr-defined]
    assert await store_case.store.inflight([e.keys.user_leases("conc", ident), *fleet_keys]) == [1, 0, 1]


async def test_worker_shed_level_timeline(store_case: StoreCase, tmp_path: Path) -> None:
    e = engine(store_case, tmp_path, [{"name": "workers", "type": "worker_utilization",
                                       "signal": {"source": "redis"}}])
    shedder = e.snapshot.workers[0]
    await store_case.store.set_value(shedder.signal_key, "1.0")
    levels = []
    for _ in range(150):
        levels.append(await sample_once(e, shedder))
        store_case.clock.advance(1.0)
    assert levels[0] == pytest.approx(-28 / 120)
    assert levels[28] == pytest.approx(0.0, abs=1e-9) and levels[148] == pytest.approx(1.0)
