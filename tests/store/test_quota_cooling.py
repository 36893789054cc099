"""The quota service's promise across replicas on a real store (issue 33, docs/rlqs.md
"Cooling across replicas"): two replicas' books on one store, the embedded one and a real
Redis on one injected clock, in front of modelled Envoy 1.40 filters
(``testinfra/quota_envoy.py``); streams move between the replicas, shares shrink and grow
with demand, Envoys and replicas restart. Requests admitted over any window t stay within
the limiter's ``rate x t + burst``: burst one replica's holder releases cools in the store
before another replica's Envoy can start a bucket full with it. (The property test with
many seeds is ``tests/fuzz/test_fuzz_quota.py``, on the embedded store.)"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import NOTHING, QuotaBook, QuotaLimit, StoreLedger, Usage
from extauthz.store.base import Store
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from testinfra.quota_envoy import BUCKET, World, drawn, established, three_replicas, two_replicas
from testinfra.redis_servers import RedisSingle
from tests.store.conftest import make_redis_store


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def store_clock(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Store, ManualClock]]:
    clock = ManualClock(0.0)
    if request.param == "memory":
        yield MemoryStore(clock), clock
        return
    topology: RedisSingle = request.getfixturevalue("redis_single_clean")
    store = make_redis_store(topology, clock)
    try:
        yield store, clock
    finally:
        await store.close()


# (seed, Envoys, (rate, burst)): the first admitted 1.44 requests past rate x t + burst
# before the store's ledger cooled released burst
CASES = [(3, 2, (0.5, 10.0)), (16, 3, (2.0, 30.0)), (5, 4, (1.0, 20.0)), (8, 3, (0.2, 6.0)), (11, 2, (1.0, 4.0))]


@pytest.mark.parametrize(("seed", "envoys", "limit"), CASES)
async def test_two_replicas_on_one_store_keep_rate_t_plus_burst(
        store_clock: tuple[Store, ManualClock], seed: int, envoys: int, limit: tuple[float, float]) -> None:
    store, clock = store_clock
    world = World(random.Random(seed), envoys, *limit, replicas=2, store=store, clock=clock,
                  keys=Keys(prefix=f"cool{seed}"))
    await two_replicas(world, envoys)
    assert world.admitted  # shares were given (the cost is early refusal, never nothing)
    assert world.worst_excess(*limit) <= 1e-6


async def test_three_replicas_restarting_on_one_store_keep_rate_t_plus_burst(
        store_clock: tuple[Store, ManualClock]) -> None:
    """Three replicas, one restarting at one tick in seven (``three_replicas``): the
    timeline that found two holds of one bucket settled in one store call (both took the
    same free units; 2.3 requests past rate x t + burst), on each store."""
    store, clock = store_clock
    rng, limit, envoys = drawn(118)
    world = World(rng, envoys, *limit, replicas=3, store=store, clock=clock, keys=Keys(prefix="three"))
    await three_replicas(world, envoys)
    assert world.admitted
    assert world.worst_excess(*limit) <= 1e-6


async def test_released_burst_cools_in_the_store_before_another_replica_takes_it(
        store_clock: tuple[Store, ManualClock]) -> None:
    """2/s with burst 20: replica a's Envoy holds it all; then b's Envoy asks 50 times as
    much, so a's share shrinks (to nothing: its part of the fill rounds down to 0) and is
    confirmed by a's next report. The burst a released stays held by a's holder until the
    fill a released has refilled it (20 at 2 a second: 10 s), and only then does b's Envoy
    get a bucket (which Envoy starts full)."""
    store, clock = store_clock
    limit = QuotaLimit(2.0, 20.0)

    def book(name: str) -> QuotaBook:
        return QuotaBook(lambda: {"per-ip": limit}, clock=clock,
                         ledger=StoreLedger(store, Keys(prefix="cooled"), replica=name))

    await store.check(established(Keys(prefix="cooled")), "")
    a, b = book("a"), book("b")
    sa, sb = a.open("envoy-a"), b.open("envoy-b")
    key = tuple(sorted(BUCKET.items()))
    first_a = await a.settle(a.report(sa, "d", [Usage(BUCKET, 0.0, 0, 1)]))
    assert first_a[sa.id][0].share == limit.total
    await b.settle(b.report(sb, "d", [Usage(BUCKET, 0.0, 0, 1)]))
    released_at = granted_at = None
    for _ in range(14):
        clock.advance(5.0)
        await a.settle(a.report(sa, "d", [Usage(BUCKET, 5.0, 1, 0)]))
        held = sa.buckets[key]
        if released_at is None and held.cool_until:
            released_at = clock.monotonic()
            assert held.cool_until == released_at + 10.0  # 20 burst at the 2 fill it released
        out = await b.settle(b.report(sb, "d", [Usage(BUCKET, 5.0, 0, 50)]))
        share = out[sb.id][0].share
        if granted_at is None and share not in (None, NOTHING):
            granted_at = clock.monotonic()
    assert released_at is not None and granted_at is not None, (released_at, granted_at)
    assert granted_at >= released_at + 10.0
