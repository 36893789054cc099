"""Batched grants (``consistency: batched``): several replicas on one shared bucket.

Each replica is its own :class:`Engine` on its own store client (a :class:`RedisStore` on a
real Redis, ``check.lua`` running; or the embedded store for the single-replica cases), all
on one :class:`ManualClock` injected into the stores and engines, so the timelines are exact
and nothing is timed. The sync turn that each replica's timer runs every half
``sync_interval`` is run by the test (``GrantTable.sync``) when the virtual clock has moved.

The guarantee (docs/limiters.md): no more admitted than the exact limiter over the run;
every refusal early by at most ``batch x (replicas - 1)`` tokens held elsewhere; and one
``sync_interval`` later, with every replica synced, nothing is held anywhere, so the
answers are the exact limiter's again.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.errors import PolicyError, StoreUnavailable
from extauthz.core.verdict import Decision, Kind, Outcome, Verdict
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.fleet import FleetSlots, FleetUsageShedder, default_fleet_batch, grant_ttl
from extauthz.limiters.grants import SEND_CHUNK, GrantTable, default_batch
from extauthz.limiters.quota import QuotaLimiter, default_quota_batch
from extauthz.limiters.refusals import RefusalCache
from extauthz.limiters.request_rate import RequestRateLimiter
from extauthz.store import algorithms
from extauthz.store.base import FleetGrantOp, GrantOp, Op, QuotaGrantOp, ReturnOp, Store
from extauthz.store.memory import MemoryStore
from extauthz.store.redis import RedisStore
from testinfra.probes import release_and_wait
from testinfra.redis_servers import RedisSingle
from tests.store.conftest import make_redis_store
from tests.unit.helpers import get, policy_from

RATE, BURST, BATCH, SYNC = 10.0, 20.0, 4.0, 0.1
#: the timer's period (half an interval), and a step well within it
HALF, EPS = SYNC / 2, 0.001
START = 5_000.123456789


def batched(tmp_path: Path, **extra: object) -> dict[str, object]:
    spec: dict[str, object] = {"name": "user-rate", "type": "request_rate", "rate": RATE, "burst": BURST,
                               "consistency": "batched", "batch": BATCH, "sync_interval": "100ms"}
    spec.update(extra)
    return spec


def table(engine: Engine) -> GrantTable:
    """The first limiter's grant table (a batched request_rate or quota)."""
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, RequestRateLimiter | QuotaLimiter) and lim.grants is not None
    return lim.grants


class Counting:
    """Counts the store calls an engine makes (the engine's ``store_check`` hook)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls: list[list[Op]] = []

    async def __call__(self, ops: list[Op], lease_id: str) -> object:
        self.calls.append(list(ops))
        return await self.store.check(ops, lease_id)


def refusals(engine: Engine) -> RefusalCache:
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, RequestRateLimiter) and lim.refusals is not None
    return lim.refusals


async def shut(tables: list[GrantTable], stores: list[RedisStore], raw: Any) -> None:
    """Stop the replicas' timers and close their store clients and the test's own."""
    for t in tables:
        t.close()
    for s in stores:
        await s.close()
    raw.close()


async def settled(tables: list[GrantTable]) -> None:
    """Wait until no replica has a store call on its way. Each replica's real timer also
    runs sync turns (every half ``sync_interval`` of wall time): one may fire while the
    test drains another replica and take a grant out to give back; until that return
    lands, its units are in the shared count but held nowhere. Drain until every table is
    idle at once (no await follows, so no timer runs before the test reads the count)."""
    while True:
        for t in tables:
            await t.drain()
        if not any(t.sending for t in tables):
            return


def rate_verdict(d: Decision) -> Outcome:
    return d.verdicts[0].outcome


# --------------------------------------------------------------------------- one replica


async def test_one_store_call_per_grant_and_headers_count_the_grant(tmp_path: Path) -> None:
    clock = ManualClock(START)
    store = MemoryStore(clock)
    count = Counting(store)
    engine = Engine(StoreGate(store, clock=clock, store_check=count),
                    policy_from(tmp_path, {"limiters": [batched(tmp_path)]}))  # type: ignore[arg-type]
    decisions = [(await engine.check(get()))[1] for _ in range(8)]
    assert all(d.allowed for d in decisions)
    assert len(count.calls) == 2  # a grant of 4 tokens serves 4 requests
    assert all(isinstance(op, GrantOp) and op.want == BATCH for ops in count.calls for op in ops)
    # remaining = grant left here + the shared bucket's last known tokens: as exact would say
    assert [d.verdicts[0].remaining for d in decisions] == [19.0 - i for i in range(8)]
    assert decisions[0].verdicts[0].reset == pytest.approx(0.1)
    table(engine).close()


async def test_exact_mode_asks_the_store_every_time(tmp_path: Path) -> None:
    clock = ManualClock(START)
    store = MemoryStore(clock)
    count = Counting(store)
    spec = {"name": "user-rate", "type": "request_rate", "rate": RATE, "burst": BURST}
    engine = Engine(StoreGate(store, clock=clock, store_check=count), policy_from(tmp_path, {"limiters": [spec]}))  # type: ignore[arg-type]
    for _ in range(5):
        await engine.check(get())
    assert len(count.calls) == 5
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, RequestRateLimiter) and lim.grants is None


class CountingStore(MemoryStore):
    """The embedded store, counting the ops of each ``check`` call (the grant tables call
    the store directly, not through the engine's ``store_check``)."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.calls: list[int] = []

    async def check(self, ops: Any, lease_id: str) -> Any:
        self.calls.append(len(ops))
        return await super().check(ops, lease_id)


async def test_a_grant_in_use_is_renewed_an_unspent_one_goes_back_then_the_key_is_forgotten(
        tmp_path: Path) -> None:
    clock = ManualClock(START)
    store = CountingStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched(tmp_path)]}))
    grants = table(engine)
    await engine.check(get())
    key = next(iter(grants._held))
    assert grants.held(key) == BATCH - 1 and store.tokens(key) == BURST - BATCH
    clock.advance(HALF - EPS)
    assert await grants.sync() == 0  # not due yet
    assert (await engine.check(get()))[1].allowed  # spent from: the key is in use
    clock.advance(2 * EPS)
    # half an interval old (the timer runs every half) and spent from in the last half
    # interval: renewed, one op that gives the unspent 2 back and takes the next grant
    store.calls.clear()
    assert await grants.sync() == 1
    assert store.calls == [1] and grants.grants == 2
    assert grants.held(key) == BATCH
    # the shared bucket: what was left, the refill since, the unspent 2, less the new grant
    assert store.tokens(key) == pytest.approx(BURST - BATCH + RATE * (HALF + EPS) + BATCH - 2 - BATCH)
    store.calls.clear()
    for _ in range(2):  # answered from the renewed grant, off the request path: no store call
        assert (await engine.check(get()))[1].allowed
    assert store.calls == [] and grants.held(key) == BATCH - 2
    clock.advance(HALF + EPS)
    assert await grants.sync() == 1  # not spent from in the last half interval: back, all of it
    assert grants.held(key) == 0.0 and grants.returned == pytest.approx(2 + BATCH - 2)
    assert store.calls == [1] and grants.grants == 2
    assert len(grants) == 1
    clock.advance(SYNC)
    await grants.sync()
    assert len(grants) == 0  # held none for a whole interval: forgotten
    grants.close()


async def test_a_sync_turn_of_many_keys_goes_back_in_a_few_calls(tmp_path: Path) -> None:
    """What is due goes back (or is renewed) in calls of SEND_CHUNK ops, one after another
    (a thousand single-return calls at once held the event loop long enough for the checks
    waiting on the store to miss their deadline)."""
    clock = ManualClock(START)
    store = CountingStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched(tmp_path)]}))
    grants = table(engine)
    users = 2 * SEND_CHUNK + 10
    for i in range(users):
        assert (await engine.check(get(key=f"sk_user_{i}")))[1].allowed
    assert store.calls == [1] * users  # one grant each
    store.calls.clear()
    clock.advance(HALF - EPS)
    for i in range(users):  # each key in use: spent from its grant, no store call
        assert (await engine.check(get(key=f"sk_user_{i}")))[1].allowed
    assert store.calls == []
    clock.advance(2 * EPS)
    assert await grants.sync() == users  # renewed
    assert store.calls == [SEND_CHUNK, SEND_CHUNK, 10]
    assert grants.total() == users * BATCH
    store.calls.clear()
    clock.advance(HALF + EPS)
    assert await grants.sync() == users  # not spent from since: back
    assert store.calls == [SEND_CHUNK, SEND_CHUNK, 10]
    assert grants.total() == 0.0
    # every unspent token is back in its shared bucket: what was left, the refill, the unspent
    back = BURST - BATCH + RATE * (2 * HALF + 2 * EPS) + BATCH - 2
    assert all(store.tokens(key) == pytest.approx(back) for key in grants._held)
    grants.close()


async def test_grants_that_land_together_keep_one_and_give_the_rest_back() -> None:
    """Requests of one key asked in one loop turn each take a grant; the replica keeps one
    grant's worth (so the bound holds) and gives the rest back at once."""
    clock = ManualClock(START)
    store = MemoryStore(clock)
    grants = GrantTable(SYNC, clock, store=store)
    op = GrantOp("k", RATE, BURST, 1.0, BATCH)
    first, second = (await store.check([op], "")).results[0], (await store.check([op], "")).results[0]
    assert (first.extra, second.extra) == (BATCH, BATCH)
    grants.granted("k", first.extra, 1.0, first.remaining, BATCH, (RATE, BURST))
    remaining = grants.granted("k", second.extra, 1.0, second.remaining, BATCH, (RATE, BURST))
    assert grants.held("k") == BATCH and remaining == BATCH + BURST - 2 * BATCH
    await grants.drain()
    assert store.tokens("k") == BURST - 2 * BATCH + (2 * BATCH - 2 - BATCH)  # the surplus is back
    assert grants.returned == BATCH - 2
    grants.close()


def test_default_batch_is_one_sync_interval_of_refill() -> None:
    assert default_batch(1000.0, 0.1, 1.0) == 100.0
    assert default_batch(2.0, 0.1, 1.0) == 1.0  # at least 1
    assert default_batch(2.0, 0.1, 3.0) == 3.0  # at least one request's cost


async def test_a_refusal_is_the_exact_refusal(tmp_path: Path) -> None:
    clock = ManualClock(START)
    engine = Engine(StoreGate(MemoryStore(clock), clock=clock),
                    policy_from(tmp_path, {"limiters": [batched(tmp_path)]}))
    decisions = [(await engine.check(get()))[1] for _ in range(21)]
    assert [d.allowed for d in decisions] == [True] * 20 + [False]
    refused = decisions[-1].denied_by
    assert refused is not None and refused.reason == "rate_exceeded"
    assert refused.retry_after == pytest.approx(0.1)
    table(engine).close()


# --------------------------------------------------------------------------- several replicas


@pytest.mark.redis
@pytest.mark.parametrize("replicas", [2, 3, 5])
async def test_replicas_never_admit_more_than_exact_and_refuse_early_by_at_most_the_bound(
        redis_single_clean: RedisSingle, tmp_path: Path, replicas: int) -> None:
    clock = ManualClock(START)
    policy = policy_from(tmp_path, {"limiters": [batched(tmp_path)]})
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(replicas)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    tables = [table(e) for e in engines]
    for t in tables:  # the test runs each replica's sync turn on the virtual clock; the real
        t.period = 1e9  # timer (every 50 ms of wall time) would run extra ones on a slow machine
    raw = redis_single_clean.client()
    key = engines[0].snapshot.limiters[0]._keys.bucket(  # type: ignore[attr-defined]
        "user-rate", engines[0].context(get()).identity)
    rng = random.Random(24)

    def shared_tokens() -> float:
        stored = raw.get(key)
        if stored is None:
            return BURST
        tokens, ts = (float(x) for x in stored.split())
        return algorithms.refill(tokens, ts, clock.now, RATE, BURST)

    admitted = refused = refused_from_cache = 0
    last_sync = clock.now
    try:
        for _ in range(400):
            i = rng.randrange(replicas)
            cache = refusals(engines[i])
            hits = cache.hits
            # a give-back on its way (a grant that landed beside another goes back at once)
            # lands first: else it could land after the store refused this check, and the
            # shared count read below would not be the one the store refused with
            await settled(tables)
            decision = (await engines[i].check(get()))[1]
            if decision.allowed:
                admitted += 1
            else:
                refused += 1
                assert rate_verdict(decision) is Outcome.DENIED
                others = sum(t.held(key) for j, t in enumerate(tables) if j != i)
                # the bound: what the others hold, and so how early this refusal can be
                assert others <= BATCH * (replicas - 1) + 1e-9
                if cache.hits == hits:  # the store refused it: with this replica's remainder
                    assert shared_tokens() + tables[i].held(key) < 1.0
                else:  # a remembered refusal: at most one sync_interval old
                    refused_from_cache += 1
                # what the exact limiter's bucket would hold: every unspent token
                assert shared_tokens() + sum(t.held(key) for t in tables) < 1.0 + BATCH * (replicas - 1)
            # never more than the exact limiter over the run: burst + refill since the start
            assert admitted <= BURST + RATE * (clock.now - START) + 1e-6
            clock.advance(rng.choice((0.0, 0.0, 0.0, 0.01, 0.03, 0.05)))
            if clock.now - last_sync >= SYNC / 2:  # each replica's timer turn
                for t in tables:
                    await t.sync()
                last_sync = clock.now
        assert refused > 0 and admitted > BURST  # the run reached the limit
        # (at the limit the bucket is nearly empty when asked, so grants are small: the
        # store calls saved are under the limit, test_one_store_call_per_grant...)
        assert sum(t.local for t in tables) > 0

        # One sync_interval later, every replica synced: nothing held anywhere (nothing was
        # spent in the last half interval: nothing renewed), and the answer is the exact
        # limiter's again (admitted iff the shared bucket admits).
        clock.advance(SYNC)
        for t in tables:
            await t.sync()
        await settled(tables)
        assert sum(t.held(key) for t in tables) == 0.0
        exact_admits = algorithms.admits(shared_tokens(), 1.0)
        assert exact_admits  # a whole interval refilled one token at least
        assert (await engines[0].check(get()))[1].allowed
    finally:
        await shut(tables, stores, raw)


@pytest.mark.redis
async def test_a_grant_is_taken_atomically_under_concurrent_replicas(
        redis_single_clean: RedisSingle, tmp_path: Path) -> None:
    """Many replicas asking at once, in one loop turn each: the grants handed out never sum
    to more than the bucket held (check.lua takes each grant atomically)."""

    clock = ManualClock(START)
    policy = policy_from(tmp_path, {"limiters": [batched(tmp_path, batch=7)]})
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(6)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    raw = redis_single_clean.client()
    try:
        results = await asyncio.gather(*(e.check(get()) for e in engines for _ in range(5)))
        for e in engines:
            await table(e).drain()
        admitted = sum(d.allowed for _, d in results)
        assert 0 < admitted <= BURST  # never more than the bucket held
        key = next(k for e in engines for k in table(e)._held)
        stored = raw.get(key)
        shared = float(stored.split()[0]) if stored is not None else BURST
        held = sum(table(e).total() for e in engines)
        assert admitted + held + shared == BURST  # nothing made, nothing lost (no time passed)
        assert all(table(e).held(key) <= 7 for e in engines)  # each holds one grant at most
    finally:
        for e in engines:
            table(e).close()
        for s in stores:
            await s.close()
        raw.close()


async def test_a_request_refused_by_another_limiter_spends_no_grant(tmp_path: Path) -> None:
    """As in exact mode (only an admitted request commits), a request the grant covered but
    another limiter refused gives its cost back to the grant."""
    clock = ManualClock(START)
    conc = {"name": "user-conc", "type": "concurrent_requests", "limit": 1}
    engine = Engine(StoreGate(MemoryStore(clock), clock=clock),
                    policy_from(tmp_path, {"limiters": [batched(tmp_path), conc]}))
    grants = table(engine)
    first = (await engine.check(get()))[1]
    assert first.allowed  # holds the one lease (not released)
    key = next(iter(grants._held))
    assert grants.held(key) == BATCH - 1
    for _ in range(3):
        second = (await engine.check(get()))[1]
        assert not second.allowed and second.denied_by is not None
        assert second.denied_by.limiter == "user-conc"
        assert grants.held(key) == BATCH - 1  # spent locally, then given back to the grant
    grants.close()


def test_batched_refusals_are_remembered_at_most_one_sync_interval() -> None:
    """Other replicas' give-backs can refill the bucket sooner than ``rate``: a remembered
    refusal ends within one ``sync_interval`` (and the store is asked again)."""
    clock = ManualClock(START)
    cache = RefusalCache(clock, max_window=SYNC)
    refused = Verdict("user-rate", Kind.RATE_LIMITER, Outcome.DENIED, limit=1.0, remaining=0.0,
                      retry_after=2.0, reset=2.0)
    cache.remember("k", refused, 0.5, 1.0, 1.0)
    clock.advance(SYNC / 2)
    assert cache.refusal("k", 0.5, 1.0, 1.0) is not None
    clock.advance(SYNC / 2)
    assert cache.refusal("k", 0.5, 1.0, 1.0) is None


@pytest.mark.parametrize("kind", ["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def test_a_late_give_back_does_not_refill_the_same_seconds_twice(
        kind: str, request: pytest.FixtureRequest) -> None:
    """A give-back rides with a later check but carries its own loop turn's clock: it adds
    its tokens without moving the bucket's clock back (which would count the seconds in
    between twice: an over-admission found by the several-replica test)."""
    clock = ManualClock(START)
    store: Store = (MemoryStore(clock) if kind == "memory"
                    else make_redis_store(request.getfixturevalue("redis_single_clean"), clock))
    try:
        take = GrantOp("k", RATE, BURST, 1.0, BURST)  # empties the bucket
        assert (await store.check([take], "")).results[0].extra == BURST
        clock.advance(1.0)  # +10 tokens
        assert (await store.check([GrantOp("k", RATE, BURST, 1.0, 10.0)], "")).results[0].extra == 10.0
        clock.set(START + 0.5)  # a give-back of 3 sent half a second earlier
        await store.check([ReturnOp("k", RATE, BURST, 3.0)], "")
        clock.set(START + 1.0)
        assert (await store.check([GrantOp("k", RATE, BURST, 1.0, BURST)], "")).results[0].extra == 3.0
    finally:
        await store.close()


async def test_a_graceful_stop_gives_back_every_grant_held(tmp_path: Path) -> None:
    clock = ManualClock(START)
    store = MemoryStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched(tmp_path)]}))
    await engine.check(get())
    key = next(iter(table(engine)._held))
    assert store.tokens(key) == BURST - BATCH
    await engine.settle_grants()  # what Server.stop does before the store closes
    assert store.tokens(key) == BURST - 1 and table(engine).total() == 0.0


class SlowStore(MemoryStore):
    """The embedded store, each call taking one loop turn (as a Redis round trip does)."""

    async def check(self, ops: Any, lease_id: str) -> Any:
        await asyncio.sleep(0)
        return await super().check(ops, lease_id)


async def test_a_renewal_on_its_way_during_a_graceful_stop_goes_back_too(tmp_path: Path) -> None:
    clock = ManualClock(START)
    store = SlowStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched(tmp_path)]}))
    await engine.check(get())
    grants = table(engine)
    key = next(iter(grants._held))
    clock.advance(HALF - EPS)
    await engine.check(get())  # in use: the grant is renewed when due
    clock.advance(2 * EPS)
    grants._spawn(grants.sync())  # the timer's turn (a tracked task)
    await asyncio.sleep(0)  # the renewal is sent; its grant lands after the stop's give-back
    await engine.settle_grants()
    assert not grants.sending and grants.grants == 2  # it did land: a grant taken, then given back
    assert grants.total() == 0.0
    assert store.tokens(key) == pytest.approx(min(BURST, BURST - 2 + RATE * (HALF + EPS)))


# --------------------------------------------------------------------------- quota

QLIMIT, QBATCH = 40, 4
#: one second into a minute: a run of under a minute stays in one quota window
QSTART = 60.0 * 100_000 + 1.0


def batched_quota(**extra: object) -> dict[str, object]:
    return {"name": "user-quota", "type": "quota", "limit": QLIMIT, "period": "minute",
            "consistency": "batched", "batch": QBATCH, "sync_interval": "100ms", **extra}


def quota_key(engine: Engine, start: float = QSTART - 1.0) -> str:
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, QuotaLimiter)
    return lim._count_key(engine.context(get()), int(start))


def counted_quota(tmp_path: Path) -> tuple[ManualClock, MemoryStore, Counting, Engine]:
    """An engine with one batched quota on the embedded store, its store calls counted."""
    clock = ManualClock(QSTART)
    store = MemoryStore(clock)
    count = Counting(store)
    engine = Engine(StoreGate(store, clock=clock, store_check=count),
                    policy_from(tmp_path, {"limiters": [batched_quota()]}))  # type: ignore[arg-type]
    return clock, store, count, engine


async def test_quota_one_store_call_per_grant_and_headers_count_the_grant(tmp_path: Path) -> None:
    _, store, count, engine = counted_quota(tmp_path)
    decisions = [(await engine.check(get()))[1] for _ in range(10)]
    assert all(d.allowed for d in decisions)
    assert len(count.calls) == 3  # grants of 4 units serve 4 requests each
    assert all(isinstance(op, QuotaGrantOp) and op.want == QBATCH for ops in count.calls for op in ops)
    # remaining = grant left here + the window's last known remaining: as exact would say
    assert [d.verdicts[0].remaining for d in decisions] == [QLIMIT - 1.0 - i for i in range(10)]
    assert all(d.verdicts[0].reset == pytest.approx(59.0) for d in decisions)
    assert store.tokens(quota_key(engine)) == 12  # 10 spent, 2 held here
    table(engine).close()


def test_quota_default_batch_is_one_percent_of_the_limit() -> None:
    assert default_quota_batch(10_000, 1) == 100
    assert default_quota_batch(40, 1) == 1  # at least one request
    assert default_quota_batch(1000, 25) == 25  # at least one request's cost


def test_a_quota_batch_is_whole_requests(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"batch \(2.5\) of a quota is whole requests"):
        policy_from(tmp_path, {"limiters": [batched_quota(batch=2.5)]})


async def test_a_quota_grant_is_never_spent_in_the_next_window(tmp_path: Path) -> None:
    clock, store, count, engine = counted_quota(tmp_path)
    grants = table(engine)
    assert (await engine.check(get()))[1].allowed
    assert grants.held(quota_key(engine)) == QBATCH - 1
    clock.advance(59.0)  # the next minute
    decision = (await engine.check(get()))[1]
    assert decision.allowed and len(count.calls) == 2  # a grant of its own window
    assert decision.verdicts[0].remaining == QLIMIT - 1.0
    assert store.tokens(quota_key(engine, QSTART + 59.0)) == QBATCH
    await grants.sync()  # the old window's grant goes back to the old window's count
    await grants.drain()
    assert store.tokens(quota_key(engine)) == 1
    grants.close()


@pytest.mark.redis
@pytest.mark.parametrize("replicas", [2, 3, 5])
async def test_quota_replicas_never_admit_more_than_the_limit_and_refuse_early_by_at_most_the_bound(
        redis_single_clean: RedisSingle, tmp_path: Path, replicas: int) -> None:
    clock = ManualClock(QSTART)
    policy = policy_from(tmp_path, {"limiters": [batched_quota()]})
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(replicas)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    tables = [table(e) for e in engines]
    raw = redis_single_clean.client()
    key = quota_key(engines[0])
    rng = random.Random(24)

    def shared_count() -> int:
        stored = raw.get(key)
        return 0 if stored is None else int(stored)

    admitted = refused = 0
    last_sync = clock.now
    try:
        for _ in range(120):
            i = rng.randrange(replicas)
            decision = (await engines[i].check(get()))[1]
            await settled(tables)
            held = [t.held(key) for t in tables]
            if decision.allowed:
                admitted += 1
            else:
                refused += 1
                assert decision.denied_by is not None and decision.denied_by.reason == "quota_exceeded"
                others = sum(h for j, h in enumerate(held) if j != i)
                assert others <= QBATCH * (replicas - 1)
                # early by at most what the others hold: at most batch x (replicas - 1)
                assert admitted >= QLIMIT - QBATCH * (replicas - 1)
            # never more than the exact limiter, and the count is every unit admitted or held
            assert admitted <= QLIMIT
            assert shared_count() == admitted + sum(held)
            clock.advance(rng.choice((0.0, 0.0, 0.01, 0.03)))
            if clock.now - last_sync >= SYNC / 2:  # each replica's timer turn
                for t in tables:
                    await t.sync()
                last_sync = clock.now
        assert refused > 0 and sum(t.local for t in tables) > 0  # the run reached the limit
        # One sync_interval later, every replica synced: nothing held anywhere, and the
        # answers are the exact limiter's again (the window's count is what was admitted).
        clock.advance(SYNC)
        for t in tables:
            await t.sync()
        await settled(tables)
        assert sum(t.held(key) for t in tables) == 0.0 and shared_count() == admitted
        expected = admitted < QLIMIT
        assert (await engines[0].check(get()))[1].allowed is expected
    finally:
        await shut(tables, stores, raw)


# --------------------------------------------------------------------------- reload


@pytest.mark.parametrize("change", [{"limit": 10, "batch": 2}, {"batch": 8}, {"consistency": "exact"}])
async def test_a_reload_gives_the_old_quota_grants_back_and_admits_no_more_than_the_new_limit(
        tmp_path: Path, change: dict[str, object]) -> None:
    clock = ManualClock(QSTART)
    store = MemoryStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched_quota()]}))
    old = table(engine)
    for _ in range(3):
        assert (await engine.check(get()))[1].allowed
    key = quota_key(engine)
    assert store.tokens(key) == QBATCH and old.held(key) == 1
    new_spec = batched_quota(**change)
    if change.get("consistency") == "exact":
        del new_spec["batch"], new_spec["sync_interval"]
    engine.set_policy(policy_from(tmp_path, {"limiters": [new_spec]}, name="new.yaml"))
    await old.drain()
    assert old.total() == 0 and store.tokens(key) == 3  # the unspent unit went back at once
    limit = int(new_spec["limit"])  # type: ignore[call-overload]
    admitted = 3
    while (await engine.check(get()))[1].allowed:
        admitted += 1
        assert admitted <= limit
    assert admitted == limit  # one replica: never early, never over
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, QuotaLimiter)
    if lim.grants is not None:
        lim.grants.close()


async def test_a_reload_gives_the_old_rate_grants_back(tmp_path: Path) -> None:
    clock = ManualClock(START)
    store = MemoryStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched(tmp_path)]}))
    old = table(engine)
    await engine.check(get())
    key = next(iter(old._held))
    assert store.tokens(key) == BURST - BATCH
    engine.set_policy(policy_from(tmp_path, {"limiters": [batched(tmp_path, burst=10.0, batch=2)]},
                                   name="new.yaml"))
    await old.drain()
    assert old.total() == 0.0 and store.tokens(key) == BURST - 1  # given back (capped at the old burst)
    admitted = 1
    while (await engine.check(get()))[1].allowed:
        admitted += 1
    assert admitted == 1 + 10  # the new burst caps the refilled bucket: never more than exact
    table(engine).close()


# --------------------------------------------------------------------------- counters


async def test_grant_counters_are_the_tables_own_status(tmp_path: Path) -> None:
    clock = ManualClock(QSTART)
    store = MemoryStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched_quota()]}))
    grants = table(engine)
    for _ in range(6):
        await engine.check(get())
    assert grants.status() == {"keys": 1, "held": 2.0, "grants_taken": 2, "grants_expired": 0,
                               "returned": 0.0, "return_errors": 0, "store_calls_saved": 4,
                               "overadmission": 0, "dropped": 0.0, "early_refusals": 0,
                               "early_refusal_amount": 0.0}
    clock.advance(SYNC)
    await grants.sync()
    await grants.drain()
    status = grants.status()
    assert (status["grants_expired"], status["returned"], status["held"]) == (1, 2.0, 0.0)
    grants.close()


async def test_a_request_refused_by_another_limiter_spends_no_quota_grant(tmp_path: Path) -> None:
    clock = ManualClock(QSTART)
    conc = {"name": "user-conc", "type": "concurrent_requests", "limit": 1}
    store = MemoryStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": [batched_quota(), conc]}))
    grants = table(engine)
    assert (await engine.check(get()))[1].allowed  # holds the one lease (not released)
    key = quota_key(engine)
    for _ in range(3):
        second = (await engine.check(get()))[1]
        assert second.denied_by is not None and second.denied_by.limiter == "user-conc"
        assert grants.held(key) == QBATCH - 1  # spent locally, then given back to the grant
    assert store.tokens(key) == QBATCH
    grants.close()


# --------------------------------------------------------------------------- fleet_usage

CAPACITY, FLEET_BATCH = 10, 3  # reserved_for_critical 0.2: 8 non-critical slots
NONCRITICAL = 8


def fleet_policy(tmp_path: Path, **extra: object) -> Any:
    spec: dict[str, object] = {"name": "fleet", "type": "fleet_usage", "capacity": CAPACITY,
                               "reserved_for_critical": 0.2, "consistency": "batched",
                               "batch": FLEET_BATCH, "sync_interval": "100ms"}
    spec.update(extra)
    return policy_from(tmp_path, {"limiters": [spec], "classification": {"rules": [
        {"match": {"methods": ["POST"], "path_prefix": "/v1/charges"}, "tier": "critical"}]}})


def slots(engine: Engine) -> FleetSlots:
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, FleetUsageShedder) and lim.grants is not None
    return lim.grants


def fleet_engine(tmp_path: Path) -> tuple[ManualClock, MemoryStore, Engine]:
    """One replica with a batched fleet_usage limiter on the embedded store."""
    clock = ManualClock(START)
    store = MemoryStore(clock)
    return clock, store, Engine(StoreGate(store, clock=clock), fleet_policy(tmp_path))


def critical() -> Any:
    return get("/v1/charges", method="POST")


async def test_fleet_one_store_call_per_grant_and_a_release_frees_the_local_slot(tmp_path: Path) -> None:
    clock = ManualClock(START)
    store = MemoryStore(clock)
    count = Counting(store)
    engine = Engine(StoreGate(store, clock=clock, store_check=count), fleet_policy(tmp_path))  # type: ignore[arg-type]
    table = slots(engine)
    lim = engine.snapshot.limiters[0]
    assert isinstance(lim, FleetUsageShedder)
    other = table.grant(lim.other_key)
    decisions = [(await engine.check(get()))[1] for _ in range(FLEET_BATCH)]
    assert all(d.allowed for d in decisions)
    assert len(count.calls) == 1 and isinstance(count.calls[0][0], FleetGrantOp)  # one grant, 3 slots
    assert (await store.inflight([other.key])) == [FLEET_BATCH]  # the grant's members
    # remaining = the free slots of the fleet: the store's + this grant's unused
    assert [d.verdicts[0].remaining for d in decisions] == [7.0, 6.0, 5.0]
    assert all(d.leases == (other.key,) and d.lease_id for d in decisions)
    # a finished request gives its slot back to the LOCAL grant (no store call) ...
    assert await release_and_wait(engine.releaser, decisions[0].leases, decisions[0].lease_id, "access_log") == 1
    assert other.used == FLEET_BATCH - 1 and (await store.inflight([other.key])) == [FLEET_BATCH]
    # ... where the next request finds it without asking the store
    assert (await engine.check(get()))[1].allowed
    assert len(count.calls) == 1
    assert table.status()["store_calls_saved"] == FLEET_BATCH  # 2 of the first 3, and this one
    # critical requests take grants of their own tier's key (count only, never refused)
    assert all([(await engine.check(critical()))[1].allowed for _ in range(4)])
    assert len(count.calls) == 3
    table.close()


async def test_fleet_slots_unused_for_sync_interval_go_back(tmp_path: Path) -> None:
    clock, store, engine = fleet_engine(tmp_path)
    table = slots(engine)
    d = (await engine.check(get()))[1]
    key = d.leases[0]
    await table.sync()
    assert (await store.inflight([key])) == [FLEET_BATCH]  # renewed, nothing given back yet
    clock.advance(0.1)
    assert await table.sync() == FLEET_BATCH - 1  # two slots unused for sync_interval
    assert (await store.inflight([key])) == [1]  # the slot in use stays, renewed
    await release_and_wait(engine.releaser, d.leases, d.lease_id, "access_log")
    clock.advance(0.1)
    assert await table.sync() == 0  # in use during the last window
    clock.advance(0.1)
    assert await table.sync() == 1  # unused for a whole window: back (within 2 x sync_interval)
    assert (await store.inflight([key])) == [0]
    table.close()


@pytest.mark.redis
@pytest.mark.parametrize("replicas", [2, 3])
async def test_fleet_replicas_never_hold_more_than_exact_and_refuse_early_by_at_most_the_bound(
        redis_single_clean: RedisSingle, tmp_path: Path, replicas: int) -> None:
    """Random arrivals and finishes on several replicas sharing one Redis: non-critical in
    flight never exceeds the exact limit (nor do the fleet's grant members), a refusal
    comes at most ``batch x (replicas - 1)`` early, critical requests are never refused, and
    one sync_interval after everything finished no slot is held anywhere."""
    rng = random.Random(replicas)
    clock = ManualClock(START)
    policy = fleet_policy(tmp_path)
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(replicas)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    tables = [slots(e) for e in engines]
    lim = engines[0].snapshot.limiters[0]
    assert isinstance(lim, FleetUsageShedder)
    raw = redis_single_clean.client()
    inflight: list[tuple[int, Decision]] = []  # (replica, decision) of non-critical requests
    refused = 0
    try:
        for _ in range(300):
            i = rng.randrange(replicas)
            if inflight and rng.random() < 0.4:  # a request finishes: its access-log entry
                j, d = inflight.pop(rng.randrange(len(inflight)))
                await release_and_wait(engines[j].releaser, d.leases, d.lease_id, "access_log")
            elif rng.random() < 0.15:
                d = (await engines[i].check(critical()))[1]
                assert d.allowed  # critical traffic is never refused here
                await release_and_wait(engines[i].releaser, d.leases, d.lease_id, "access_log")
            else:
                d = (await engines[i].check(get()))[1]
                if d.allowed:
                    inflight.append((i, d))
                else:
                    refused += 1
                    free_elsewhere = sum(t.grant(lim.other_key).free for j, t in enumerate(tables) if j != i)
                    assert free_elsewhere <= FLEET_BATCH * (replicas - 1)
                    # the exact limiter would refuse too once those free slots are counted
                    assert len(inflight) + free_elsewhere >= NONCRITICAL
            assert len(inflight) <= NONCRITICAL  # never more than exact admits
            assert raw.zcard(lim.other_key) <= NONCRITICAL  # grant members and leases alike
            assert all(t.status()["overadmission"] == 0 for t in tables)  # as the store sees it
            clock.advance(rng.choice((0.0, 0.0, 0.01, 0.03)))
            for t in tables:  # each replica's timer turn
                await t.sync()
        assert refused > 0  # the run reached the limit
        assert sum(t.local for t in tables) > 0
        for j, d in inflight:
            await release_and_wait(engines[j].releaser, d.leases, d.lease_id, "access_log")
        for _ in range(3):
            clock.advance(0.1)
            for t in tables:
                await t.sync()
        assert raw.zcard(lim.other_key) == 0 and sum(t.held() for t in tables) == 0
    finally:
        await shut(tables, stores, raw)  # type: ignore[arg-type]


@pytest.mark.redis
async def test_a_replica_that_stops_renewing_gives_its_fleet_slots_back_after_their_life(
        redis_single_clean: RedisSingle, tmp_path: Path) -> None:
    """A replica that dies holds its slots (the one in use and the free ones it could still
    have spent) for the grant TTL plus ``lease_ttl``: a slot taken at the last moment is
    counted as long as an exact lease taken then; then they come back."""
    clock = ManualClock(START)
    policy = fleet_policy(tmp_path, batch=NONCRITICAL)  # one replica can take every slot
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(2)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    dead, alive = slots(engines[0]), slots(engines[1])
    raw = redis_single_clean.client()
    try:
        assert dead.life == dead.ttl + 60.0  # the default lease_ttl
        assert (await engines[0].check(get()))[1].allowed  # takes all 8 slots as its grant
        assert not (await engines[1].check(get()))[1].allowed  # none left for the other replica
        # the first replica dies (no renewal, no give-back); the other keeps its timer
        clock.advance(dead.life - 0.01)
        await alive.sync()
        assert not (await engines[1].check(get()))[1].allowed  # still held
        clock.advance(0.01)
        assert (await engines[1].check(get()))[1].allowed  # its slots came back
        assert raw.zcard(engines[1].snapshot.limiters[0].other_key)  # type: ignore[attr-defined] == NONCRITICAL
    finally:
        await shut([dead, alive], stores, raw)  # type: ignore[list-item]


async def test_a_reload_gives_the_free_fleet_slots_back_and_keeps_those_in_use(tmp_path: Path) -> None:
    _, store, engine = fleet_engine(tmp_path)
    old = slots(engine)
    d = (await engine.check(get()))[1]
    key = d.leases[0]
    engine.set_policy(fleet_policy(tmp_path, batch=2))
    await old.drain()
    assert (await store.inflight([key])) == [1]  # the free slots went back; the used one stays
    assert old.retired and not old.done
    # the old grant still takes its lease back (the release finds it), then holds nothing
    assert await release_and_wait(engine.releaser, d.leases, d.lease_id, "access_log") == 1
    await old.sync()
    assert old.done and (await store.inflight([key])) == [0]
    assert "fleet" in engine.grants.status()
    old.close()
    slots(engine).close()


def test_fleet_default_batch_and_grant_ttl() -> None:
    assert default_fleet_batch(800) == 8 and default_fleet_batch(50) == 1
    assert default_fleet_batch(80_000_000) == 100  # capped: a grant's slots are sorted-set members
    assert grant_ttl(0.1, 60.0) == 1.0 and grant_ttl(0.5, 60.0) == 5.0 and grant_ttl(10.0, 30.0) == 30.0


def test_a_fleet_batch_is_whole_slots(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="whole slots"):
        fleet_policy(tmp_path, batch=2.5)
    with pytest.raises(PolicyError, match="at most 1000 slots"):
        fleet_policy(tmp_path, batch=1001)


async def test_a_fleet_growth_that_failed_open_is_asked_again_and_leaks_nothing(tmp_path: Path) -> None:
    """The store failed on a growth (the request fails open): nothing is remembered for it,
    and the next request asks the grant again (not an exact lease)."""
    clock = ManualClock(START)
    store = MemoryStore(clock)
    calls: list[list[Op]] = []

    async def failing(ops: list[Op], lease_id: str) -> object:
        calls.append(list(ops))
        if len(calls) == 1:
            raise StoreUnavailable("down")
        return await store.check(ops, lease_id)

    engine = Engine(StoreGate(store, clock=clock, store_check=failing), fleet_policy(tmp_path))  # type: ignore[arg-type]
    table = slots(engine)
    assert (await engine.check(get()))[1].allowed  # failed open
    assert not table._asked and not table._taken
    assert (await engine.check(get()))[1].allowed
    assert isinstance(calls[1][0], FleetGrantOp)  # a growth again, not an exact lease
    table.close()


# --------------------------------------------------------------------------- early refusals


@pytest.mark.redis
async def test_free_fleet_slots_that_stood_here_while_the_fleet_was_full_show_as_early_refusal(
        redis_single_clean: RedisSingle, tmp_path: Path) -> None:
    """A holds 2 free slots while B fills the rest of the fleet and is refused (exact would
    have admitted 2 more): when A gives them back, the store's answer says the fleet was full
    without them, and A's early-refusal histogram observes 2."""
    clock = ManualClock(START)
    policy = fleet_policy(tmp_path)
    stores = [make_redis_store(redis_single_clean, clock) for _ in range(2)]
    engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy) for s in stores]
    a, b = (slots(e) for e in engines)
    raw = redis_single_clean.client()
    try:
        assert (await engines[0].check(get()))[1].allowed  # A: a grant of 3, 2 free
        admitted = [(await engines[1].check(get()))[1].allowed for _ in range(NONCRITICAL)]
        assert sum(admitted) == NONCRITICAL - 3 and not admitted[-1]  # refused early by 2
        assert b.status()["early_refusals"] == 0
        for _ in range(2):
            clock.advance(SYNC)
            await a.sync()
        assert a.grant(engines[0].snapshot.limiters[0].other_key).free == 0  # type: ignore[attr-defined]
        assert (a.status()["early_refusals"], a.status()["early_refusal_amount"]) == (1, 2.0)
        buckets, total = engines[0].grants.early()["fleet"]
        assert buckets[:2] == [("1.0", 0.0), ("2.0", 1.0)] and buckets[-1] == ("+Inf", 1.0) and total == 2.0
    finally:
        await shut([a, b], stores, raw)  # type: ignore[list-item]


async def test_a_bucket_grant_given_back_to_a_dry_bucket_shows_as_early_refusal(tmp_path: Path) -> None:
    """Two replicas on one bucket: A holds 3 unspent tokens while B empties the bucket and is
    refused; A's give-back lands in a bucket that could not pay one token without it."""
    clock = ManualClock(START)
    store = MemoryStore(clock)
    policy = policy_from(tmp_path, {"limiters": [batched(tmp_path, rate=0.001)]})
    engines = [Engine(StoreGate(store, clock=clock), policy) for _ in range(2)]
    a, b = (table(e) for e in engines)
    assert (await engines[0].check(get()))[1].allowed  # A: a grant of 4, 3 left
    admitted = [(await engines[1].check(get()))[1].allowed for _ in range(int(BURST))]
    assert sum(admitted) == BURST - BATCH and not admitted[-1]
    clock.advance(HALF)
    await a.sync()
    await a.drain()
    assert (a.status()["early_refusals"], a.status()["early_refusal_amount"]) == (1, 3.0)
    assert b.status()["early_refusals"] == 0
    a.close()
    b.close()


async def test_a_stale_grant_is_not_shown_as_held() -> None:
    """``held`` (what inspect shows, and the ``remaining`` an answer adds) skipped the staleness
    check ``spend`` applies: a grant held past ``sync_interval`` (its replica stood still) is
    never spent, so it is not held either; reading it drops nothing."""
    clock = ManualClock(START)
    store = MemoryStore(clock)
    grants = GrantTable(SYNC, clock, spend_within=SYNC, store=store)
    result = (await store.check([GrantOp("k", RATE, BURST, 1.0, BATCH)], "")).results[0]
    grants.granted("k", result.extra, 1.0, result.remaining, BATCH, (RATE, BURST))
    assert grants.held("k") == BATCH - 1
    clock.advance(SYNC - EPS)
    assert grants.held("k") == BATCH - 1  # still spendable
    clock.advance(2 * EPS)  # no sync ran meanwhile
    assert grants.held("k") == 0.0
    assert grants.dropped == 0.0  # a read, not a drop
    assert grants.spend("k", 1.0, (RATE, BURST)) is None and grants.dropped == BATCH - 1
    grants.close()
