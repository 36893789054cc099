"""The seed's limiter cases through the engine on every store (embedded, single Redis,
Redis Cluster, Sentinel): the same behaviour whatever holds the state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from extauthz.control.overrides import make_override
from extauthz.core.context import RawRequest
from extauthz.core.verdict import Decision
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.worker import sample_once
from testinfra.probes import release_and_wait

from ..unit.helpers import get, policy_from
from .conftest import StoreCase


def engine(case: StoreCase, tmp_path: Path, limiters: list[dict[str, object]]) -> Engine:
    policy = policy_from(tmp_path, {"limiters": limiters,
                                    "classification": {"rules": [
                                        {"match": {"path_prefix": "/v1/charges"}, "tier": "critical"}]}})
    return Engine(StoreGate(case.store, clock=case.clock, deadline=1.0), policy, rng=random.Random(7))


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
        assert await release_and_wait(e.releaser, d.leases, d.lease_id, "access_log") == 1
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


# -- plans and overrides: the same answers on every store --------------------------------


def plan_engine(case: StoreCase, tmp_path: Path, limiters: list[dict[str, object]]) -> Engine:
    policy = policy_from(tmp_path, {"limiters": limiters,
                                    "plan": {"from": [{"header": "x-plan"}], "default": "free"}})
    # a generous deadline: a fail-open on a loaded machine would admit one request too many
    return Engine(StoreGate(case.store, clock=case.clock, deadline=5.0), policy, salt=b"salt")


def on_plan(key: str, plan: str) -> RawRequest:
    return get(key=key, headers={"x-plan": plan})


PLAN_RATE = {"name": "user-rate", "type": "request_rate", "rate": 1, "burst": 5,
             "plans": {"pro": {"rate": 100, "burst": 500}, "free": {"rate": 10, "burst": 50}}}


async def test_seed_timeline_for_a_plan_while_another_plan_keeps_its_own(
        store_case: StoreCase, tmp_path: Path) -> None:
    e = plan_engine(store_case, tmp_path, [PLAN_RATE])
    pro, free = on_plan("sk_live_pro", "pro"), on_plan("sk_live_free", "free")
    got_pro: list[bool] = []
    got_free: list[bool] = []
    for i in range(501):  # interleaved: one customer's traffic does not touch the other's
        got_pro.append((await e.check(pro))[1].allowed)
        if i < 51:
            got_free.append((await e.check(free))[1].allowed)
    assert sum(got_pro) == 500 and not got_pro[-1]  # 500 allowed, the 501st refused
    assert sum(got_free) == 50 and not got_free[-1]
    store_case.clock.advance(1.0)
    assert sum([(await e.check(pro))[1].allowed for _ in range(101)]) == 100  # +1 s: 100 more
    assert sum([(await e.check(free))[1].allowed for _ in range(11)]) == 10  # free: its own 10


def remaining(d: Decision, limiter: str = "user-rate") -> float | None:
    return next(v.remaining for v in d.verdicts if v.limiter == limiter)


async def test_a_plan_change_carries_tokens_capped_at_the_new_burst(
        store_case: StoreCase, tmp_path: Path) -> None:
    e = plan_engine(store_case, tmp_path, [PLAN_RATE])
    for _ in range(100):
        _, d = await e.check(on_plan("sk_live_a", "pro"))
    assert remaining(d) == pytest.approx(400)
    _, d = await e.check(on_plan("sk_live_a", "free"))  # the next request, on the new plan
    assert d.allowed and remaining(d) == pytest.approx(49)  # min(400, 50) - 1
    _, d = await e.check(on_plan("sk_live_a", "pro"))  # back: carried, not refilled
    assert d.allowed and remaining(d) == pytest.approx(48)
    store_case.clock.advance(0.5)  # refilled at pro's 100/s
    _, d = await e.check(on_plan("sk_live_a", "pro"))
    assert remaining(d) == pytest.approx(97)


async def test_plan_and_override_numbers_for_concurrency(store_case: StoreCase, tmp_path: Path) -> None:
    e = plan_engine(store_case, tmp_path, [{"name": "conc", "type": "concurrent_requests", "limit": 1,
                                            "plans": {"pro": {"limit": 3}}}])
    assert [(await e.check(on_plan("sk_live_p", "pro")))[1].allowed for _ in range(4)] == [True] * 3 + [False]
    assert [(await e.check(on_plan("sk_live_f", "free")))[1].allowed for _ in range(2)] == [True, False]
    ident = e.context(on_plan("sk_live_f", "free")).identity
    e.set_overrides([make_override("conc", ident, {"limit": 2}, ttl=60, now=store_case.clock.wall())])
    assert [(await e.check(on_plan("sk_live_f", "free")))[1].allowed for _ in range(2)] == [True, False]


async def test_an_override_wins_over_the_plan_on_every_store(store_case: StoreCase, tmp_path: Path) -> None:
    e = plan_engine(store_case, tmp_path, [PLAN_RATE])
    ident = e.context(on_plan("sk_live_o", "free")).identity
    e.set_overrides([make_override("user-rate", ident, {"burst": 7, "rate": 2}, ttl=60,
                                   now=store_case.clock.wall())])
    got = [(await e.check(on_plan("sk_live_o", "free")))[1] for _ in range(8)]
    assert [d.allowed for d in got] == [True] * 7 + [False]
    assert got[-1].denied_by is not None and got[-1].denied_by.limit == 7
    assert got[-1].denied_by.retry_after == pytest.approx(0.5)  # one token at the override's 2/s
    # another customer on the same plan keeps the plan's numbers
    assert sum([(await e.check(on_plan("sk_live_x", "free")))[1].allowed for _ in range(51)]) == 50
