"""One fleet, one level: two replicas (two engines, two Redis clients) sampling the same
signal on one real Redis share one controller state and converge on one shed level."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from extauthz.clock import ManualClock
from extauthz.engine import Engine
from extauthz.sampler import sample_once
from extauthz.store.redis import RedisStore
from tests.infra.redis_servers import RedisSingle

from ..unit.helpers import policy_from

pytestmark = pytest.mark.redis

RESTING = -28 / 120


async def test_two_replicas_converge_on_one_level(tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    policy = policy_from(tmp_path, {"limiters": [{
        "name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
        "sample_interval": "8s"}]})
    clock = ManualClock(start=50_000.0)
    stores = [RedisStore.from_url(redis_single_clean.url, now=clock.wall) for _ in range(2)]
    a, b = (Engine(s, policy, clock=clock, rng=random.Random(i)) for i, s in enumerate(stores))
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
        a = Engine(first, policy, clock=clock)
        for _ in range(10):
            await sample_once(a, a.snapshot.workers[0])
            clock.advance(8.0)
        b = Engine(late, policy, clock=clock)  # a replica that just started
        level = await sample_once(b, b.snapshot.workers[0])
        assert level == pytest.approx(RESTING + 10 * 8.0 / 120)
    finally:
        await first.close()
        await late.close()
