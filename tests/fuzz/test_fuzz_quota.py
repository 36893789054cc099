"""The quota service's promise, property-style, through a model of Envoy 1.40's quota filter
(``testinfra/quota_envoy.py``): requests admitted by every Envoy holding one bucket, over any
window t, never exceed the limiter's ``rate x t + burst`` (docs/rlqs.md), through shares
moving between Envoys, Envoys restarting, streams closing and reopening, answers delayed on
the way, a lowered limit; and across two replicas' books on one store (the embedded one
here; real Redis in ``tests/store/test_quota_cooling.py``), streams moving between them and
replicas restarting. Every event runs on an injected clock."""

from __future__ import annotations

import asyncio
import random
from functools import partial

from hypothesis import example, given, settings
from hypothesis import strategies as st

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import REPORT_INTERVAL, QuotaLimit
from extauthz.store.memory import MemoryStore
from testinfra import quota_envoy
from testinfra.probes import flushall
from testinfra.quota_envoy import World, drawn, three_replicas, two_replicas

LIMITS = st.sampled_from([(0.5, 2.0), (1.0, 4.0), (2.0, 4.0), (3.0, 10.0), (0.2, 3.0)])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(1, 4), limit=LIMITS)
def test_admitted_never_exceed_rate_t_plus_burst_as_shares_move(seed: int, envoys: int,
                                                                 limit: tuple[float, float]) -> None:
    rng = random.Random(seed)
    world = World(rng, envoys, *limit)
    # demand moves between the Envoys every 10-30 s
    for _ in range(4):
        weights = [rng.choice([0.0, 0.1, 1.0, 9.0]) for _ in range(envoys)]
        asyncio.run(world.run(rng.uniform(10, 30), weights, mean_gap=rng.choice([0.05, 0.2, 1.0])))
    assert world.worst_excess(*limit) <= 1e-6


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(1, 3), limit=LIMITS)
def test_the_promise_holds_through_restarts_and_reconnects(seed: int, envoys: int,
                                                          limit: tuple[float, float]) -> None:
    rng = random.Random(seed)
    world = World(rng, envoys, *limit)
    for _ in range(4):
        weights = [rng.choice([0.0, 0.1, 1.0, 9.0]) for _ in range(envoys)]
        asyncio.run(world.run(rng.uniform(10, 30), weights, mean_gap=rng.choice([0.05, 0.2]),
                              restarts=0.1, reconnects=0.15))
    assert world.worst_excess(*limit) <= 1e-6


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(1, 3), limit=LIMITS, lower=st.sampled_from([0.25, 0.5]))
@example(seed=20, envoys=3, limit=(2.0, 4.0), lower=0.25)  # the interval alone changed for one Envoy
def test_a_lowered_limit_holds_from_one_report_and_delivery_after_the_reload(
        seed: int, envoys: int, limit: tuple[float, float], lower: float) -> None:
    rng = random.Random(seed)
    world = World(rng, envoys, *limit)
    asyncio.run(world.run(rng.uniform(10, 30), [rng.choice([0.1, 1.0, 9.0]) for _ in range(envoys)], mean_gap=0.05))
    assert world.worst_excess(*limit) <= 1e-6
    reloaded = world.clock.monotonic()
    rate, burst = limit[0] * lower, max(1.0, limit[1] * lower)
    world.limit = QuotaLimit(rate, burst)  # read at the next report, shrinks pushed to every Envoy
    for _ in range(3):
        asyncio.run(world.run(rng.uniform(10, 20), [rng.choice([0.1, 1.0, 9.0]) for _ in range(envoys)], mean_gap=0.05))
    # every Envoy reports within 5 s and its answer arrives within 2 s (the model's delays)
    assert world.worst_excess(rate, burst, since=reloaded + REPORT_INTERVAL + 2.0) <= 1e-6


#: with bursts many seconds of fill deep, released burst outlasts a shrink's confirmation
WIDE_LIMITS = st.sampled_from(quota_envoy.WIDE_LIMITS)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(2, 4), limit=WIDE_LIMITS)
@example(seed=3, envoys=2, limit=(0.5, 10.0))  # 1.44 over without the store's cooling
def test_the_promise_holds_across_two_replicas_on_one_store(seed: int, envoys: int,
                                                           limit: tuple[float, float]) -> None:
    """Two replicas' books on one embedded store: streams move between them (a broken
    stream reconnects to either), shares shrink and grow with demand, Envoys and replicas
    restart; what one replica's holder releases must cool in the store before the other's
    Envoy can start a bucket full with it."""
    rng = random.Random(seed)
    clock = ManualClock(0.0)
    world = World(rng, envoys, *limit, replicas=2, store=MemoryStore(clock), clock=clock)
    asyncio.run(two_replicas(world, envoys))
    assert world.worst_excess(*limit) <= 1e-6


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(2, 3), limit=WIDE_LIMITS, lower=st.sampled_from([0.25, 0.5]))
def test_a_lowered_limit_holds_across_two_replicas(seed: int, envoys: int, limit: tuple[float, float],
                                                   lower: float) -> None:
    """A reload lowers the limit while both replicas' streams hold slices of the old one
    (streams moving between them): from one report and delivery after it, the new
    ``rate x t + burst`` holds."""
    rng = random.Random(seed)
    clock = ManualClock(0.0)
    world = World(rng, envoys, *limit, replicas=2, store=MemoryStore(clock), clock=clock)

    async def run() -> float:
        weights = [rng.choice([0.1, 1.0, 9.0]) for _ in range(envoys)]
        await world.run(rng.uniform(10, 30), weights, mean_gap=0.05, reconnects=0.1)
        reloaded = clock.monotonic()
        rate, burst = limit[0] * lower, max(1.0, limit[1] * lower)
        world.limit = QuotaLimit(rate, burst)
        for _ in range(3):
            weights = [rng.choice([0.1, 1.0, 9.0]) for _ in range(envoys)]
            await world.run(rng.uniform(10, 20), weights, mean_gap=0.05, reconnects=0.1)
        return world.worst_excess(rate, burst, since=reloaded + REPORT_INTERVAL + 2.0)

    assert asyncio.run(run()) <= 1e-6


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(2, 5), limit=WIDE_LIMITS)
def test_the_promise_holds_across_three_replicas_restarting_mid_cooling(seed: int, envoys: int,
                                                                        limit: tuple[float, float]) -> None:
    """Three replicas' books on one embedded store, one restarting often: a replica's
    report settles several of its streams' holds of the bucket at once, and a restarted
    replica's holds cool in the store under their TTL and tail, not in its memory."""
    rng = random.Random(seed)
    clock = ManualClock(0.0)
    world = World(rng, envoys, *limit, replicas=3, store=MemoryStore(clock), clock=clock)
    asyncio.run(three_replicas(world, envoys))
    assert world.worst_excess(*limit) <= 1e-6


def test_three_replicas_found_two_holds_of_one_bucket_in_one_store_call() -> None:
    """The timeline that found it (the limit and the number of Envoys drawn from the seed):
    a replica's report settled two of its streams' holds of the bucket in one store call,
    both took the same free units, and 2.3 requests were admitted past rate x t + burst."""
    rng, limit, envoys = drawn(118)
    clock = ManualClock(0.0)
    world = World(rng, envoys, *limit, replicas=3, store=MemoryStore(clock), clock=clock)
    asyncio.run(three_replicas(world, envoys))
    assert world.worst_excess(*limit) <= 1e-6


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(2, 5), limit=WIDE_LIMITS,
       replicas=st.integers(1, 3))
def test_the_promise_holds_through_a_store_losing_its_data(seed: int, envoys: int, limit: tuple[float, float],
                                                           replicas: int) -> None:
    """The store's ledger wiped at random ticks (``testinfra.probes.flushall``, as a Redis
    restarted empty) while the Envoys enforce what they were sent: every replica finds its
    marker gone at its next settle and grows no share until those assignments ran out and
    cooled (docs/rlqs.md "A store that loses its data")."""
    rng = random.Random(seed)
    clock = ManualClock(0.0)
    store = MemoryStore(clock)
    world = World(rng, envoys, *limit, replicas=replicas, store=store, clock=clock, wipe=partial(flushall, store))
    asyncio.run(quota_envoy.wiped_ledger(world, envoys))
    assert world.worst_excess(*limit) <= 1e-6


# (seed, replicas): timelines of ``wiped_ledger`` (the limit and the Envoys drawn from the
# seed) that went past rate x t + burst before the marker (by 5.42, 4.52 and 1.69 requests)
WIPED = [(4, 3), (18, 3), (57, 3)]


def test_the_timelines_a_lost_ledger_broke_keep_the_promise() -> None:
    for seed, replicas in WIPED:
        rng, limit, envoys = drawn(seed)
        clock = ManualClock(0.0)
        store = MemoryStore(clock)
        world = World(rng, envoys, *limit, replicas=replicas, store=store, clock=clock, wipe=partial(flushall, store))
        asyncio.run(quota_envoy.wiped_ledger(world, envoys))
        assert world.wiped  # the store lost its data in the timeline
        assert world.admitted
        assert world.worst_excess(*limit) <= 1e-6, (seed, replicas)
