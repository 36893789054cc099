"""One behavioural suite, run against every store (see ``conftest.py``): the contract of
:mod:`extauthz.store.base`, with the memory store's semantics as the reference.

Keys come from :class:`~extauthz.store.keys.Keys`, so a request mixes a user's slot and
the fleet slot as in production: on Redis Cluster that exercises the per-slot groups and
their compensation.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from extauthz.control.overrides import make_override, parse_overrides, with_override
from extauthz.control.switches import parse_switches
from extauthz.core.verdict import Mode
from extauthz.store import algorithms
from extauthz.store.base import (
    BucketOp,
    CheckResult,
    CountOp,
    GrantOp,
    LeaseOp,
    Op,
    PeekOp,
    QuotaGrantOp,
    ShedParams,
    Store,
)
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from testinfra.probes import change_overrides, change_switches, key_count
from tests.store.conftest import StoreCase, key_expiry_times, key_ttls, redis_time_ms

K = Keys("t")
BUCKET = K.bucket("rate", "alice")
OTHER_BUCKET = K.bucket("rate2", "alice")
USER_LEASES = K.user_leases("conc", "alice")
FLEET = K.fleet_leases("fleet", "other")
FLEET_ALL = K.fleet_leases("workers", "all")


def bucket(key: str = BUCKET, rate: float = 100, burst: float = 500, cost: float = 1,
           enforce: bool = True) -> BucketOp:
    return BucketOp(key, rate, burst, cost, enforce)


def lease(key: str = USER_LEASES, limit: int = 2, ttl: float = 30, enforce: bool = True) -> LeaseOp:
    return LeaseOp(key, limit, ttl, enforce)


async def many(store: Store, ops: list[Op], n: int, prefix: str = "r") -> list[CheckResult]:
    """``n`` checks issued together (the Redis store batches them)."""
    return list(await asyncio.gather(*(store.check(ops, f"{prefix}{i}") for i in range(n))))


# --------------------------------------------------------------------------- token bucket


async def test_bucket_seed_gist_timeline(store_case: StoreCase) -> None:
    """The seed's numbers: rate 100/s, burst 500."""
    store, clock = store_case.store, store_case.clock
    results = await many(store, [bucket()], 501)
    assert sum(r.admitted for r in results) == 500
    refused = [r for r in results if not r.admitted]
    assert len(refused) == 1
    res = refused[0].results[0]
    assert (res.allowed, res.remaining, res.extra) == (False, 0.0, 5.0)
    assert res.retry_after == pytest.approx(0.01)  # one token at 100/s

    clock.advance(1.0)
    first = await store.check([bucket()], "a")
    assert first.admitted
    assert first.results[0].remaining == 99.0
    assert first.results[0].retry_after == 0.0
    assert first.results[0].extra == pytest.approx(4.01)  # (500 - 99) / 100 s to full
    results = await many(store, [bucket()], 100)
    assert sum(r.admitted for r in results) == 99
    assert not (await store.check([bucket()], "b")).admitted


async def test_bucket_remaining_and_reset(store: Store) -> None:
    res = (await store.check([bucket(rate=10, burst=20)], "a")).results[0]
    assert (res.allowed, res.remaining, res.retry_after) == (True, 19.0, 0.0)
    assert res.extra == pytest.approx(0.1)


async def test_bucket_fractional_refill(store_case: StoreCase) -> None:
    """Sub-second refill: binary fractions keep every value exact on every store."""
    store, clock = store_case.store, store_case.clock
    op = bucket(rate=4, burst=2)
    assert [(await store.check([op], f"r{i}")).admitted for i in range(3)] == [True, True, False]
    clock.advance(0.125)  # half a token
    half = await store.check([op], "h")
    assert not half.admitted
    assert half.results[0].remaining == 0.5
    assert half.results[0].retry_after == 0.125
    clock.advance(0.125)  # one token
    one = await store.check([op], "o")
    assert one.admitted
    assert one.results[0].remaining == 0.0
    assert not (await store.check([op], "p")).admitted


async def test_bucket_cost(store: Store) -> None:
    op = bucket(rate=10, burst=10, cost=3)
    remaining = []
    for i in range(3):
        res = await store.check([op], f"r{i}")
        assert res.admitted
        remaining.append(res.results[0].remaining)
    assert remaining == [7.0, 4.0, 1.0]
    denied = (await store.check([op], "x")).results[0]
    assert (denied.allowed, denied.remaining) == (False, 1.0)
    assert denied.retry_after == pytest.approx(0.2)  # 2 missing tokens at 10/s
    assert denied.extra == pytest.approx(0.9)


async def test_bucket_full_after_idle(store_case: StoreCase) -> None:
    store, clock = store_case.store, store_case.clock
    op = bucket(rate=1, burst=3)
    for i in range(3):
        assert (await store.check([op], f"r{i}")).admitted
    clock.advance(3600)  # far past the key TTL: never more than burst
    res = await many(store, [op], 4)
    assert sum(r.admitted for r in res) == 3


async def test_bucket_clock_going_back_refills_nothing(store_case: StoreCase) -> None:
    store, clock = store_case.store, store_case.clock
    op = bucket(rate=1, burst=1)
    assert (await store.check([op], "a")).admitted
    clock.set(clock.now - 5)  # e.g. another replica's "now" (only injected clocks do this)
    res = await store.check([op], "b")
    assert not res.admitted
    assert res.results[0].remaining == 0.0


# --------------------------------------------------------------------------- leases


async def test_lease_limit_and_release(store: Store) -> None:
    op = lease(limit=2)
    first = await store.check([op], "l1")
    assert first.admitted
    assert (first.results[0].remaining, first.results[0].extra) == (1.0, 1.0)
    second = await store.check([op], "l2")
    assert (second.admitted, second.results[0].remaining, second.results[0].extra) == (True, 0.0, 2.0)
    third = await store.check([op], "l3")
    assert not third.admitted
    assert (third.results[0].remaining, third.results[0].extra, third.results[0].retry_after) == (
        0.0, 2.0, 0.0)
    assert await store.inflight([USER_LEASES]) == [2]

    assert await store.release([USER_LEASES], "l1") == 1
    assert await store.release([USER_LEASES], "l1") == 0  # idempotent
    assert await store.release([USER_LEASES], "never-held") == 0
    assert await store.inflight([USER_LEASES]) == [1]
    assert (await store.check([op], "l3")).admitted


async def test_lease_expires_at_ttl(store_case: StoreCase) -> None:
    store, clock = store_case.store, store_case.clock
    op = lease(limit=1, ttl=30)
    assert (await store.check([op], "a")).admitted
    clock.advance(29.5)
    assert await store.inflight([USER_LEASES]) == [1]
    assert not (await store.check([op], "b")).admitted
    clock.advance(0.5)  # expiry == now: swept
    assert await store.inflight([USER_LEASES]) == [0]
    assert (await store.check([op], "c")).admitted
    assert await store.release([USER_LEASES], "a") == 0  # gone with its expiry


async def test_count_only_leases(store: Store) -> None:
    op = lease(FLEET_ALL, limit=0)
    results = await many(store, [op], 50)
    assert all(r.admitted for r in results)
    assert all(r.results[0].remaining == math.inf for r in results)
    assert sorted(r.results[0].extra for r in results) == [float(i) for i in range(1, 51)]
    assert await store.inflight([FLEET_ALL]) == [50]


async def test_inflight_and_release_across_slots(store: Store) -> None:
    ops: list[Op] = [lease(USER_LEASES, limit=5), lease(FLEET, limit=5), lease(FLEET_ALL, limit=0)]
    assert (await store.check(ops, "a")).admitted
    assert (await store.check(ops[1:], "b")).admitted
    assert await store.inflight([FLEET_ALL, USER_LEASES, FLEET]) == [2, 1, 2]
    assert await store.release([USER_LEASES, FLEET, FLEET_ALL], "a") == 3
    assert await store.inflight([USER_LEASES, FLEET, FLEET_ALL]) == [0, 1, 1]
    assert await store.inflight([]) == []
    assert await store.release([], "a") == 0


# --------------------------------------------------------------------------- atomic batch


async def test_denied_by_a_later_op_commits_nothing(store: Store) -> None:
    """No partial commits: the first bucket and the lease are untouched when a later
    (fleet-slot) op refuses."""
    fleet = lease(FLEET, limit=1)
    assert (await store.check([fleet], "holder")).admitted
    ops: list[Op] = [bucket(burst=5), lease(USER_LEASES, limit=5), fleet]
    res = await store.check(ops, "refused")
    assert not res.admitted
    assert [r.allowed for r in res.results] == [True, True, False]
    assert res.results[0].remaining == 5.0  # reported as not taken
    assert res.results[1].extra == 0.0
    assert await store.inflight([USER_LEASES, FLEET]) == [0, 1]
    alone = await store.check([bucket(burst=5)], "next")
    assert alone.results[0].remaining == 4.0  # the refused request took no token


async def test_denied_by_user_op_gives_fleet_lease_back(store: Store) -> None:
    user = lease(USER_LEASES, limit=1)
    assert (await store.check([user], "holder")).admitted
    ops: list[Op] = [lease(FLEET, limit=10), user, bucket(OTHER_BUCKET, burst=5)]
    res = await store.check(ops, "refused")
    assert not res.admitted
    assert [r.allowed for r in res.results] == [True, False, True]
    assert await store.inflight([FLEET, USER_LEASES]) == [0, 1]
    assert (await store.check([bucket(OTHER_BUCKET, burst=5)], "n")).results[0].remaining == 4.0


async def test_a_request_refused_elsewhere_leaves_every_op_kind_as_it_was(store: Store) -> None:
    """Every op kind whose commit a refused request must not keep (a bucket's tokens, a
    grant's, a quota count's units, a quota grant's, a lease) is as it was when a fleet-slot
    op refuses: never committed, or on a Cluster committed in the user's slot and given back
    by its rule's refund (``algorithms.Rule.refund``, compensate.lua)."""
    fleet = lease(FLEET, limit=1)
    assert (await store.check([fleet], "holder")).admitted
    count, granted = K.quota("q", "alice", 0), K.quota("qg", "alice", 0)
    ops: list[Op] = [bucket(burst=5), GrantOp(OTHER_BUCKET, 1, 5, 1, 3), CountOp(count, 3, 2, 60, 60.0),
                     QuotaGrantOp(granted, 6, 1, 4, 60, 60.0), lease(USER_LEASES, limit=5), fleet]
    res = await store.check(ops, "refused")
    assert not res.admitted
    assert [r.allowed for r in res.results] == [True, True, True, True, True, False]
    peeks = [PeekOp("bucket", BUCKET, 100, 5), PeekOp("bucket", OTHER_BUCKET, 1, 5), PeekOp("count", count),
             PeekOp("count", granted), PeekOp("leases", USER_LEASES)]
    assert await store.peek(peeks) == [5.0, 5.0, 0.0, 0.0, 0.0]
    assert (await store.check(ops[:-1], "alone")).admitted  # and what it did not keep is there
    assert await store.peek(peeks) == [4.0, 2.0, 2.0, 4.0, 1.0]


async def test_admitted_commits_every_op(store: Store) -> None:
    ops: list[Op] = [bucket(burst=5), lease(USER_LEASES, limit=5), lease(FLEET, limit=5)]
    res = await store.check(ops, "ok")
    assert res.admitted
    assert [r.remaining for r in res.results] == [4.0, 4.0, 4.0]
    assert await store.inflight([USER_LEASES, FLEET]) == [1, 1]
    assert await store.release([USER_LEASES, FLEET], "ok") == 2


async def test_shadow_op_never_blocks_and_is_not_committed_when_refusing(store: Store) -> None:
    drained = bucket(OTHER_BUCKET, rate=1, burst=1)
    assert (await store.check([drained], "drain")).admitted
    shadow_refusing = BucketOp(OTHER_BUCKET, 1, 1, 1, enforce=False)
    shadow_lease = lease(FLEET, limit=3, enforce=False)
    res = await store.check([bucket(burst=5), shadow_refusing, shadow_lease], "a")
    assert res.admitted
    assert [r.allowed for r in res.results] == [True, False, True]
    assert res.results[1].remaining == 0.0
    assert res.results[2].extra == 1.0  # an allowing shadow op is committed
    assert await store.inflight([FLEET]) == [1]

    # An enforced refusal is not turned into a commit of the shadow ops either.
    full = lease(USER_LEASES, limit=1)
    assert (await store.check([full], "holder")).admitted
    res = await store.check([shadow_lease, full], "b")
    assert not res.admitted
    assert await store.inflight([FLEET, USER_LEASES]) == [1, 1]


async def test_empty_check_is_admitted(store: Store) -> None:
    assert await store.check([], "x") == CheckResult(True, ())


# --------------------------------------------------------------------------- plain values


async def test_values(store_case: StoreCase) -> None:
    store = store_case.store
    key = K.signal("w")
    assert await store.get_value(key) is None
    await store.set_value(key, "0.5")
    assert await store.get_value(key) == "0.5"
    assert store_case.value_ttl(key) is None
    await store.set_value(key, "0.75", ttl=60)
    assert await store.get_value(key) == "0.75"
    ttl = store_case.value_ttl(key)
    assert ttl is not None and 59 < ttl <= 60
    await store.set_value(key, None)
    assert await store.get_value(key) is None
    await store.set_value(K.switches, '{"*": "shadow"}')
    assert await store.get_value(K.switches) == '{"*": "shadow"}'


async def test_swap_value_is_a_compare_and_set(store_case: StoreCase) -> None:
    store, key = store_case.store, K.overrides
    assert await store.swap_value(key, None, "a", 60)
    assert not await store.swap_value(key, None, "b", 60)  # another writer set it first
    assert not await store.swap_value(key, "x", "b", 60)
    assert await store.get_value(key) == "a"
    assert await store.swap_value(key, "a", "b", 60) and await store.get_value(key) == "b"
    ttl = store_case.value_ttl(key)
    assert ttl is not None and 59 < ttl <= 60  # every key expires
    assert not await store.swap_value(key, "a", None, 60)
    assert await store.swap_value(key, "b", None, 60) and await store.get_value(key) is None


async def test_two_operators_changing_the_overrides_at_once_lose_nothing(store_case: StoreCase) -> None:
    """Operator B's change lands between operator A's read and write: A's compare-and-set
    fails, A reads again and applies its change on top of B's."""
    now = store_case.wall()
    a = make_override("user-rate", "a" * 24, {"rate": 5}, ttl=600, now=now)
    b = make_override("user-rate", "b" * 24, {"rate": 7}, ttl=600, now=now)

    class BRacesA:
        def __init__(self, inner: Store) -> None:
            self.inner, self.raced = inner, False

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        async def swap_value(self, key: str, expected: str | None, value: str | None,
                             ttl: float | None = None) -> bool:
            if not self.raced:
                self.raced = True
                await change_overrides(self.inner, K, lambda e: with_override(e, b, now), now)
            return await self.inner.swap_value(key, expected, value, ttl)

    racing = BRacesA(store_case.store)
    result = await change_overrides(racing, K, lambda e: with_override(e, a, now), now)  # type: ignore[arg-type]
    assert racing.raced and result == [a, b]
    assert parse_overrides(await store_case.store.get_value(K.overrides)) == [a, b]
    assert await store_case.store.get_value(K.overrides_version) is not None

    # the kill switches go through the same compare-and-set: B flips "fleet" while A flips "*"
    class BFlipsToo(BRacesA):
        async def swap_value(self, key: str, expected: str | None, value: str | None,
                             ttl: float | None = None) -> bool:
            if not self.raced:
                self.raced = True
                await change_switches(self.inner, K.switches, "fleet", Mode.OFF)
            return await self.inner.swap_value(key, expected, value, ttl)

    flipping = BFlipsToo(store_case.store)
    both = await change_switches(flipping, K.switches, "*", Mode.SHADOW)  # type: ignore[arg-type]
    assert flipping.raced and both.to_dict() == {"*": "shadow", "fleet": "off"}
    assert parse_switches(await store_case.store.get_value(K.switches)).to_dict() == both.to_dict()
    assert store_case.value_ttl(K.switches) is None  # a switch holds until cleared


async def test_value_expires(store_case: StoreCase) -> None:
    store = store_case.store
    await store.set_value("t:v", "x", ttl=0.05)
    assert await store.get_value("t:v") == "x"
    store_case.let_values_expire(0.05)
    assert await store.get_value("t:v") is None


# --------------------------------------------------------------------------- event logs


async def test_event_log_keeps_about_maxlen_newest(store_case: StoreCase) -> None:
    store = store_case.store
    events = [f'{{"n": {i}}}' for i in range(5)]
    await store.append_events(K.shadow_log, events[:2], maxlen=3, ttl=60)
    await store.append_events(K.shadow_log, events[2:], maxlen=3, ttl=60)
    got = await store.read_events(K.shadow_log, since=0)
    assert len(got) >= 3  # Redis trims approximately (MAXLEN ~): at least maxlen, newest kept
    assert got == events[-len(got):]  # oldest first
    assert await store.read_events(K.shadow_log, since=store_case.wall() + 3600) == []
    assert await store.read_events("t:no-log", since=0) == []


# --------------------------------------------------------------------------- shed controller


async def test_shed_update_follows_the_controller(store_case: StoreCase) -> None:
    store, clock = store_case.store, store_case.clock
    p = ShedParams(good_below=0.7, bad_above=0.8, delay_before_shedding=28, time_to_shed_all=120,
                   ttl=300)
    key = K.shed_state("w")
    timeline = [(0, 0.95)] + [(5, 1.0)] * 12 + [(60, 1.0), (1, 0.75), (2.5, 0.3)] + [(7, 0.0)] * 8
    level: float | None = None
    last: float | None = None
    levels = []
    for dt, utilization in timeline:
        clock.advance(dt)
        expected = algorithms.shed_advance(level, last, clock.now, utilization, p)
        got = await store.shed_update(key, utilization, p)
        assert got == pytest.approx(expected, abs=1e-12)
        level, last = got, clock.now
        levels.append(got)
    assert levels[0] == p.resting
    assert max(levels) > 0  # it shed, then recovered
    assert levels[-1] < max(levels)


# --------------------------------------------------------------------------- TTLs


async def test_every_key_has_a_ttl(store_case: StoreCase) -> None:
    """Idle users cost nothing: every key a run leaves behind expires on its own."""
    store = store_case.store
    p = ShedParams(0.7, 0.8, 28, 120, 60)
    before = None if store_case.topology is None else redis_time_ms(store_case.topology)
    await many(store, [bucket(rate=1000, burst=1), lease(USER_LEASES), lease(FLEET, limit=0)], 3)
    await store.check([bucket(OTHER_BUCKET, rate=1, burst=5)], "x")
    await store.check([lease(FLEET_ALL, limit=0, ttl=0.2)], "y")
    if store_case.topology is None:
        # The embedded store has no key TTLs: it forgets idle buckets and expired leases
        # in its periodic sweep.
        assert isinstance(store, MemoryStore)
        assert key_count(store) == 5
        store_case.clock.advance(31.0)  # past every bucket's idle time and lease TTL
        store._sweep(store_case.clock.monotonic())
        assert key_count(store) == 0
        return
    await store.shed_update(K.shed_state("w"), 0.9, p)
    await store.set_value(K.signal("w"), "0.9", ttl=0.5)
    await store.append_events(K.shadow_log, ["{}"], maxlen=10, ttl=60)
    ttls = key_ttls(store_case.topology)
    assert set(ttls) == {BUCKET, OTHER_BUCKET, USER_LEASES, FLEET, FLEET_ALL,
                         K.shed_state("w"), K.signal("w"), K.shadow_log}
    assert all(ms > 0 for ms in ttls.values()), ttls
    # Each expiry was set from Redis's clock while the checks ran (between ``before`` and
    # ``after``): absolute expiry times bound it exactly, whatever the machine's speed.
    assert before is not None
    after = redis_time_ms(store_case.topology)
    expiry = key_expiry_times(store_case.topology)
    def set_with(key: str) -> tuple[int, int]:
        return expiry[key] - after, expiry[key] - before
    lo, hi = set_with(BUCKET)
    assert lo <= 1000 <= hi  # max(1, ceil(2 * 1 / 1000)) s: never 0
    lo, hi = set_with(FLEET_ALL)
    assert lo <= 1000 <= hi  # a lease TTL under 1 s is stored as 1 s
    lo, hi = set_with(OTHER_BUCKET)
    assert lo <= 10000 <= hi  # twice the fill time: 2 * 5 / 1 s
    lo, hi = set_with(USER_LEASES)
    assert lo <= 30000 <= hi  # the lease TTL
