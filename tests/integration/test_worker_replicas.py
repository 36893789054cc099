"""One fleet, one level: two replicas (two engines, two Redis clients) sampling the same
signal on one real Redis share one controller state and converge on one shed level; the
controller step runs in Python and the state is swapped in with a compare-and-set
(``lua/shed_state.lua``)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.worker import sample_once
from extauthz.store.base import ShedParams
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import RedisSingle

from ..unit.helpers import policy_from

pytestmark = pytest.mark.redis

RESTING = -28 / 120


async def test_two_replicas_converge_on_one_level(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = policy_from(tmp_path, {"limiters": [{
        "name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
        "sample_interval": "8s"}]})
    clock = ManualClock(start=50_000.0)
    stores = [RedisStore.from_url(redis_single_clean.url, now=clock.wall) for _ in range(2)]
    a, b = (Engine(StoreGate(s, clock=clock), policy, rng=random.Random(i)) for i, s in enumerate(stores))
    try:
        await stores[0].set_value("extauthz:signal:workers", "1.0")
        wa, wb = a.snapshot.workers[0], b.snapshot.workers[0]
        await sample_once(a, wa)  # the fleet's controller starts at rest
        await sample_once(b, wb)
        assert wa.level == pytest.approx(RESTING) and wb.level == pytest.approx(RESTING)
        for tick in range(1, 20):
            clock.advance(5.0)  # replica A samples ...
            level_a = await sample_once(a, wa)
            clock.advance(3.0)  # ... and B 3 s later, within the same 8 s interval
            level_b = await sample_once(b, wb)
            assert level_a is not None and level_b is not None
            # B continues A's state: the fleet's level moves at one controller's pace,
            # not twice as fast, and the replicas differ by at most one interval's change.
            assert level_b == pytest.approx(min(1.0, RESTING + 8.0 * tick / 120))
            assert abs(level_b - level_a) <= 8.0 / 120 + 1e-9
        assert wa.probabilities == a.snapshot.workers[0].probabilities
        clock.advance(8.0)
        assert await sample_once(a, wa) == pytest.approx(1.0)
        assert wa.level == pytest.approx(wb.level)
    finally:
        for s in stores:
            await s.close()


async def test_a_new_replica_picks_up_the_fleet_level(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = policy_from(tmp_path, {"limiters": [{
        "name": "workers", "type": "worker_utilization", "signal": {"source": "redis"}}]})
    clock = ManualClock(start=80_000.0)
    first = RedisStore.from_url(redis_single_clean.url, now=clock.wall)
    late = RedisStore.from_url(redis_single_clean.url, now=clock.wall)
    try:
        await first.set_value("extauthz:signal:workers", "1.0")
        a = Engine(StoreGate(first, clock=clock), policy)
        for _ in range(10):
            await sample_once(a, a.snapshot.workers[0])
            clock.advance(8.0)
        b = Engine(StoreGate(late, clock=clock), policy)  # a replica that just started
        level = await sample_once(b, b.snapshot.workers[0])
        assert level == pytest.approx(RESTING + 10 * 8.0 / 120)
    finally:
        await first.close()
        await late.close()


async def test_replicas_sampling_at_once_step_from_each_others_state(redis_single_clean: RedisSingle) -> None:
    """Two replicas read the same state and both try to write a step: the compare-and-set
    lets one in; the other steps again from that state. Replica B's clock is 3 s behind A's,
    so a blind write from the state both read would leave B's smaller step (R + 5/120)."""
    params = ShedParams(0.7, 0.8, 28, 120, 300)
    clock_a, clock_b = ManualClock(start=90_008.0), ManualClock(start=90_005.0)
    a = RedisStore.from_url(redis_single_clean.url, now=clock_a.wall)
    b = RedisStore.from_url(redis_single_clean.url, now=clock_b.wall)
    start = RedisStore.from_url(redis_single_clean.url, now=lambda: 90_000.0)
    try:
        for round_ in range(5):
            key = f"extauthz:{{fleet}}:shed:w{round_}"
            assert await start.shed_update(key, 1.0, params) == params.resting
            await asyncio.gather(a.shed_update(key, 1.0, params), b.shed_update(key, 1.0, params))
            # a dead-zone sample at A's time reads the level back unchanged
            assert await a.shed_update(key, 0.75, params) == pytest.approx(RESTING + 8 / 120, abs=1e-12)
    finally:
        for s in (a, b, start):
            await s.close()


async def test_shed_state_script_swaps_only_the_state_it_was_given(redis_single_clean: RedisSingle) -> None:
    store = RedisStore.from_url(redis_single_clean.url, now=lambda: 100.0)
    key = "extauthz:{fleet}:shed:cas"
    try:
        got = await store._run("shed_state", [key], ["", "get"])
        assert [int(got[0]), got[1], got[2]] == [0, b"", b""]
        assert float(got[3]) > 1e9  # no injected "now" in ARGV[1]: Redis TIME
        set_ = ["100.0", "set", "", "", "0.5", "100.0", "60"]
        assert int((await store._run("shed_state", [key], set_))[0]) == 1
        stale = await store._run("shed_state", [key], ["101.5", "set", "", "", "0.9", "101.5", "60"])
        assert [int(stale[0]), stale[1], stale[2], stale[3]] == [0, b"0.5", b"100.0", b"101.5"]
        ok = await store._run("shed_state", [key], ["101.5", "set", "0.5", "100.0", "0.9", "101.5", "60"])
        assert [int(ok[0]), ok[1], ok[2]] == [1, b"0.9", b"101.5"]
        with redis_single_clean.client() as client:
            assert 59_000 < client.pttl(key) <= 60_000
    finally:
        await store.close()
