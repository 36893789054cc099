"""The embedded store and Redis give the same answers.

Hypothesis generates timelines (limiters with non-binary rates, bursts and costs; quota
counts over windows; several users and a fleet key; enforce/shadow mixes; random gaps and gaps that land exactly on a
refill boundary, on a lease's expiry or on the retry-after just answered; releases in
between) and runs each one against a :class:`MemoryStore` and a :class:`RedisStore` on a
real Redis (``lua/check.lua`` runs), both reading one :class:`ManualClock`. Every answer must
be identical: admitted, per-op allowed, remaining, retry-after and reset, compared with
``==`` (no tolerance: both stores apply :mod:`extauthz.store.algorithms` to bit-identical
raw state, because every number crosses to Redis as ``repr(float)`` and back as ``%.17g``).
The shed controller is compared the same way over random utilization samples.

Examples are bounded (``EXTAUTHZ_DIFFERENTIAL_EXAMPLES``, default 60) and derandomized, so
CI runs the same timelines in a few seconds; raise the count locally to search harder.

One caveat, handled by the generator: Redis expires idle bucket keys on its own clock
(after ``max(1, ceil(2 * burst / rate))`` real seconds), which the injected clock cannot
move. A key that expires that way is full again in the memory store only if the virtual
time moved as far, so each example runs in well under that second of real time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.resources
import itertools
import math
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.grants import bucket_renew
from extauthz.store import algorithms
from extauthz.store.base import (
    BucketOp,
    CheckResult,
    CountOp,
    FleetGrantOp,
    GrantOp,
    LeaseOp,
    Op,
    QuotaGrantOp,
    QuotaReturnOp,
    ReturnOp,
    ShedParams,
    SliceOp,
    Store,
)
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from testinfra.redis_servers import RedisSingle
from tests.store.conftest import StoreCase, make_redis_store
from tests.unit.helpers import policy_from

EXAMPLES = int(os.environ.get("EXTAUTHZ_DIFFERENTIAL_EXAMPLES", "60"))
DIFFERENTIAL = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: deliberately not binary fractions: 1/7 s, 0.3 tokens... are where float rounding bites
RATES = (7.0, 3.0, 0.7, 13.3, 100 / 3)
BURSTS = (1.0, 1.7, 2.3, 5.0)
COSTS = (1.0, 0.3, 0.7, 2.5)
LEASE_TTLS = (1.0, 10 / 7, 2.5)
#: batched grants: tokens one grant wants (below, at and above the bursts)
WANTS = (1.0, 0.7, 2.3, 3.1, 9.0)
#: a replica's remainder given back with a grant (less than a cost, or not)
HELD = (0.0, 0.0, 0.3, 0.7, 1 / 7)
#: tokens given back (a return is capped at burst)
AMOUNTS = (0.3, 1.0, 2.5, 1 / 7)
GAPS = (0.0, 1 / 7, 1 / 3, 0.1, 0.3, 1.0, 10 / 7, 2.5)
#: a start that is not a round number: ``now - last`` rounds the way it does in production
START = 1_000_003.123456789

_example = itertools.count()


@dataclass(frozen=True)
class Bucket:
    name: str
    rate: float
    burst: float


@dataclass(frozen=True)
class Leases:
    name: str
    limit: int  # 0: count only
    ttl: float
    fleet: bool  # one key for every user (fleet_usage) or one per user (concurrent_requests)


@dataclass(frozen=True)
class Count:
    """A quota: windows of ``window`` virtual seconds (:data:`QUOTA_WINDOWS`), one key per
    window."""

    name: str
    limit: int
    window: float = 2.0


#: quota windows in virtual seconds (the key names the window, as QuotaLimiter's does): a
#: ``second``, a short one the timelines cross often, and a ``year`` (366 days) none ends
QUOTA_WINDOWS = (1.0, 2.0, 366 * 86400.0)
#: a count's TTL: far beyond any timeline (Redis expires it on its own clock)
QUOTA_TTL = 3600


@dataclass(frozen=True)
class Grants:
    """A bucket asked in batched grants (``GrantOp``) of ``want`` tokens."""

    name: str
    rate: float
    burst: float
    want: float
    #: the remainder the replica gives back with each grant it asks
    held: float


@dataclass(frozen=True)
class CountGrants:
    """A quota asked in batched grants (``QuotaGrantOp``) of ``want`` units; windows as
    :class:`Count`'s."""

    name: str
    limit: int
    want: int
    #: the remainder the replica gives back with each grant it asks
    held: int
    window: float = 2.0


Limiter = Bucket | Leases | Count | Grants | CountGrants


@dataclass(frozen=True)
class Check:
    user: int
    #: (limiter index, enforce, cost); each limiter at most once per request
    ops: tuple[tuple[int, bool, float], ...]
    #: when refused, wait exactly the retry-after answered and send it again (a client that
    #: obeys Retry-After: the refill boundary where float rounding bites)
    obey: bool = False


@dataclass(frozen=True)
class Advance:
    #: a gap in seconds; "retry": the retry-after of the last refusal; "expiry": up to the
    #: expiry of the newest lease, to the bit; (k, i): k tokens of limiter i's refill (k / rate);
    #: ("ttl", i): limiter i's lease TTL
    gap: float | str | tuple[int, int] | tuple[str, int]


@dataclass(frozen=True)
class Release:
    pick: int  # an earlier admitted request, modulo how many there are


@dataclass(frozen=True)
class Inflight:
    pass


@dataclass(frozen=True)
class GiveBack:
    """A replica gives unspent granted tokens back (``ReturnOp``) to limiter ``pick``'s
    bucket of ``user`` (modulo the limiters; nothing when it is not a bucket)."""

    pick: int
    user: int
    amount: float
    #: seconds the give-back's clock is behind (it rode with a later check: grant_stamp)
    late: float = 0.0
    #: a batched bucket's renewal instead (``grants.bucket_renew``: ``amount`` given back and
    #: the next grant taken, one op of cost 0)
    renew: bool = False


Step = Check | Advance | Release | Inflight | GiveBack


def _limiters(i: int) -> dict[type[Op], st.SearchStrategy[Limiter]]:
    """The limiters a timeline draws, by the op kind each one's checks send (:func:`_ops`)."""
    return {
        BucketOp: st.builds(Bucket, st.just(f"b{i}"), st.sampled_from(RATES), st.sampled_from(BURSTS)),
        LeaseOp: st.builds(Leases, st.just(f"l{i}"), st.integers(0, 3), st.sampled_from(LEASE_TTLS),
                           st.booleans()),
        CountOp: st.builds(Count, st.just(f"q{i}"), st.integers(1, 4), st.sampled_from(QUOTA_WINDOWS)),
        GrantOp: st.builds(Grants, st.just(f"g{i}"), st.sampled_from(RATES), st.sampled_from(BURSTS),
                           st.sampled_from(WANTS), st.sampled_from(HELD)),
        QuotaGrantOp: st.builds(CountGrants, st.just(f"c{i}"), st.integers(1, 6), st.integers(1, 4),
                                st.integers(0, 2), st.sampled_from(QUOTA_WINDOWS)),
    }


#: the op kinds the timelines' limiters send only with ``grants`` (batched grants)
GRANT_KINDS = (GrantOp, QuotaGrantOp)


def _limiter(i: int, grants: bool) -> st.SearchStrategy[Limiter]:
    return st.one_of(*(lim for kind, lim in _limiters(i).items() if grants or kind not in GRANT_KINDS))


#: a give-back step of a timeline with grants: a ``ReturnOp`` for a bucket's grants, a
#: ``QuotaReturnOp`` for a quota's (:func:`_give_back`)
GIVE_BACKS = st.builds(GiveBack, st.integers(0, 3), st.integers(0, 1), st.sampled_from(AMOUNTS),
                       st.sampled_from((0.0, 1 / 7, 0.5, 0.5)), st.booleans())


@st.composite
def timelines(draw: st.DrawFn, grants: bool = False) -> tuple[tuple[Limiter, ...], list[Step]]:
    """Random timelines; ``grants``: with batched grants and give-backs too (and no lease
    releases: those timelines are the other tests')."""
    n = draw(st.integers(1, 4))
    limiters = tuple(draw(_limiter(i, grants)) for i in range(n))
    op = st.tuples(st.integers(0, n - 1), st.sampled_from((True, True, True, False)),
                   st.sampled_from(COSTS))
    check = st.builds(Check, st.integers(0, 1),
                      st.lists(op, min_size=1, max_size=n, unique_by=lambda o: o[0]).map(tuple),
                      st.booleans())
    gap = st.one_of(
        st.sampled_from(GAPS),
        st.floats(0.0, 3.0, allow_nan=False, allow_infinity=False),
    )
    boundary = st.one_of(  # exactly when a token is due, a retry-after ends, a lease's TTL
        st.just("retry"),
        st.tuples(st.integers(1, 3), st.integers(0, n - 1)),
        st.tuples(st.just("ttl"), st.integers(0, n - 1)),
    )
    steps = {"check": check, "gap": st.builds(Advance, gap), "boundary": st.builds(Advance, boundary),
             "expiry": st.just(Advance("expiry")), "release": st.builds(Release, st.integers(0, 50)),
             "inflight": st.just(Inflight())}
    if grants:
        del steps["release"]
        steps["give_back"] = GIVE_BACKS
    kinds = draw(st.lists(st.sampled_from(("check",) * 4 + tuple(steps)), min_size=8, max_size=30))
    return limiters, [draw(steps[kind]) for kind in kinds]


def _ops(keys: Keys, limiters: Sequence[Limiter], check: Check, now: float) -> list[Op]:
    ops: list[Op] = []
    user = f"user{check.user}"
    for index, enforce, cost in check.ops:
        lim = limiters[index]
        if isinstance(lim, Count):
            window = math.floor(now / lim.window)
            ops.append(CountOp(keys.quota(lim.name, user, window), lim.limit, math.ceil(cost), QUOTA_TTL,
                               (window + 1) * lim.window - now, enforce))
        elif isinstance(lim, Bucket):
            ops.append(BucketOp(keys.bucket(lim.name, user), lim.rate, lim.burst, cost, enforce))
        elif isinstance(lim, Grants):
            ops.append(GrantOp(keys.bucket(lim.name, user), lim.rate, lim.burst, min(cost, lim.burst),
                               max(lim.want, cost), enforce, lim.held))
        elif isinstance(lim, CountGrants):
            window = math.floor(now / lim.window)
            units = min(math.ceil(cost), lim.limit)
            ops.append(QuotaGrantOp(keys.quota(lim.name, user, window), lim.limit, units,
                                    max(lim.want, units), QUOTA_TTL, (window + 1) * lim.window - now,
                                    enforce, lim.held))
        else:
            key = keys.fleet_leases(lim.name, "other") if lim.fleet else keys.user_leases(lim.name, user)
            ops.append(LeaseOp(key, lim.limit, lim.ttl, enforce))
    return ops


def _give_back(keys: Keys, limiters: Sequence[Limiter], step: GiveBack,
               now: float) -> ReturnOp | QuotaReturnOp | GrantOp | None:
    lim = limiters[step.pick % len(limiters)]
    if isinstance(lim, Leases | Count):
        return None
    if isinstance(lim, CountGrants):  # whole units, to the window of now
        return QuotaReturnOp(keys.quota(lim.name, f"user{step.user}", math.floor(now / lim.window)),
                             math.ceil(step.amount))
    if isinstance(lim, Grants) and step.renew:
        return bucket_renew(keys.bucket(lim.name, f"user{step.user}"), (lim.rate, lim.burst), step.amount,
                            lim.want)
    return ReturnOp(keys.bucket(lim.name, f"user{step.user}"), lim.rate, lim.burst, step.amount)


def _gap(gap: float | str | tuple[int, int] | tuple[str, int], limiters: Sequence[Limiter],
         last_retry: float) -> float:
    if isinstance(gap, float):
        return gap
    if gap in ("retry", "expiry"):
        return last_retry if gap == "retry" else 0.0  # expiry: set by the caller
    assert isinstance(gap, tuple)
    what, index = gap
    lim = limiters[index]
    if what == "ttl":
        return lim.ttl if isinstance(lim, Leases) else 1.0
    assert isinstance(what, int)
    if isinstance(lim, Count | CountGrants):
        return min(lim.window, 2.0) * what / 2  # on a (short) window's end, or half-way
    return what / lim.rate if isinstance(lim, Bucket | Grants) else what * 0.5


async def _run(stores: Sequence[Store], clock: ManualClock, keys: Keys,
               limiters: Sequence[Limiter], steps: Sequence[Step]) -> None:
    admitted: list[tuple[list[str], str]] = []
    lease_keys = sorted({op.key for check in steps if isinstance(check, Check)
                         for op in _ops(keys, limiters, check, 0.0) if isinstance(op, LeaseOp)})
    last_retry = 0.0
    expiry = 0.0  # of the newest lease: ``now + ttl``, the float both stores store
    log: list[str] = []
    for n, step in enumerate(steps):
        if isinstance(step, Check):
            for attempt in range(2 if step.obey else 1):
                ops = _ops(keys, limiters, step, clock.now)
                lease_id = f"r{n}.{attempt}"
                results: list[CheckResult] = [await s.check(ops, lease_id) for s in stores]
                log.append(f"t={clock.now!r} check {ops} -> {results[0]}")
                assert all(r == results[0] for r in results), "\n".join([*log, repr(results)])
                refused = [r.retry_after for r in results[0].results if not r.allowed and r.retry_after > 0]
                if refused:
                    last_retry = max(refused)
                if results[0].admitted:
                    admitted.append(([op.key for op in ops if isinstance(op, LeaseOp)], lease_id))
                    expiry = max([expiry, *(clock.now + op.ttl for op in ops if isinstance(op, LeaseOp))])
                    break
                if not refused:
                    break  # refused by a lease: no retry-after to obey
                clock.advance(last_retry)
                log.append(f"advance {last_retry!r} (retry-after)")
        elif isinstance(step, Advance):
            if step.gap == "expiry" and expiry > clock.now:
                clock.set(expiry)  # not advance(expiry - now): that may round off the boundary
                log.append(f"set {expiry!r}")
                continue
            gap = _gap(step.gap, limiters, last_retry)
            clock.advance(gap)
            log.append(f"advance {gap!r}")
        elif isinstance(step, Release):
            if admitted:
                held, lease_id = admitted[step.pick % len(admitted)]
                counts = [await s.release(held, lease_id) for s in stores]
                log.append(f"release {lease_id} -> {counts}")
                assert len(set(counts)) == 1, "\n".join(log)
        elif isinstance(step, GiveBack):
            back = _give_back(keys, limiters, step, clock.now)
            if back is not None:
                now = clock.now
                clock.set(now - step.late)
                answers = [await s.check([back], "") for s in stores]
                clock.set(now)
                log.append(f"t={clock.now!r} give back {back} -> {answers[0]}")
                assert all(a == answers[0] for a in answers), "\n".join([*log, repr(answers)])
                assert answers[0].admitted
                if isinstance(back, ReturnOp):
                    assert answers[0].results[0].remaining <= back.burst
        else:
            counts_per_store = [await s.inflight(lease_keys) for s in stores]
            log.append(f"inflight -> {counts_per_store}")
            assert all(c == counts_per_store[0] for c in counts_per_store), "\n".join(log)
    final = [await s.inflight(lease_keys) for s in stores]
    assert all(c == final[0] for c in final), "\n".join([*log, repr(final)])


Body = Callable[[Store, Store, ManualClock, Keys], Awaitable[None]]


def _both(redis: RedisSingle, body: Body) -> None:
    """Run ``body(memory, redis_store, clock, keys)`` on a fresh pair of stores."""
    async def main() -> None:
        clock = ManualClock(START)
        # No background expiry on the embedded side: Redis's key TTLs run on its real clock,
        # not on this injected one, so an untouched lease key outlives its leases there (a
        # late release still finds the member). Both stores expire leases when their key is
        # read, which is what answers depend on; the sweep itself: test_memory_sweep.py.
        memory = MemoryStore(clock, sweep_batch=0)
        remote = make_redis_store(redis, clock)
        keys = Keys(f"d{next(_example)}")  # every example on keys of its own
        try:
            await body(memory, remote, clock, keys)
        finally:
            await remote.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def redis_up(redis_single: RedisSingle) -> RedisSingle:
    redis_single.ensure_up()
    redis_single.flushall()
    return redis_single


# --------------------------------------------------------------------------- the regression


async def test_the_next_token_on_time_is_admitted(store_case: StoreCase) -> None:
    """Rate 7/s, burst 1: the second request 1/7 s after the first is admitted by every
    store (before the fix Redis refused it with Retry-After: 1: ``(t + 1/7 - t) * 7`` is
    just under 1 in floating point)."""
    store, clock = store_case.store, store_case.clock
    clock.set(START)
    op = BucketOp(Keys("t").bucket("rate7", "alice"), rate=7.0, burst=1.0, cost=1.0)
    first = await store.check([op], "a")
    assert first.admitted and first.results[0].remaining == 0.0
    clock.advance(1 / 7)
    second = await store.check([op], "b")
    assert second.admitted
    assert (second.results[0].remaining, second.results[0].retry_after) == (0.0, 0.0)
    third = await store.check([op], "c")  # at the same instant: the bucket is empty
    assert not third.admitted
    assert third.results[0].retry_after == pytest.approx(1 / 7)


async def test_a_lease_is_swept_exactly_at_its_expiry(store_case: StoreCase) -> None:
    """Expiry == now is expired, in check.lua as in the memory store (``<=`` both sides)."""
    store, clock = store_case.store, store_case.clock
    clock.set(START)
    op = LeaseOp(Keys("t").user_leases("conc", "alice"), limit=1, ttl=10 / 7)
    assert (await store.check([op], "a")).admitted
    clock.advance(10 / 7 - 1e-6)
    assert not (await store.check([op], "b")).admitted
    clock.set(START + 10 / 7)  # the lease's expiry, to the last bit
    res = await store.check([op], "c")
    assert res.admitted and res.results[0].extra == 1.0


def test_check_lua_uses_the_python_epsilon() -> None:
    source = importlib.resources.files("extauthz.lua").joinpath("check.lua").read_text()
    found = re.findall(r"^local TOKEN_EPSILON = (\S+)$", source, re.MULTILINE)
    assert found and float(found[0]) == algorithms.TOKEN_EPSILON
    assert "tokens + TOKEN_EPSILON >= cost" in source


# --------------------------------------------------------------------------- random timelines


@pytest.mark.redis
@DIFFERENTIAL
@given(timeline=timelines())
def test_stores_agree_on_random_timelines(redis_up: RedisSingle,
                                          timeline: tuple[tuple[Limiter, ...], list[Step]]) -> None:
    limiters, steps = timeline

    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        await _run([memory, remote], clock, keys, limiters, steps)

    _both(redis_up, body)



async def _run_batched(memory: Store, remote: Store, clock: ManualClock, keys: Keys,
                       limiters: Sequence[Limiter], steps: Sequence[Step]) -> None:
    """The timeline in batches: the checks and releases between two clock moves are sent to
    Redis at once (one merged ``check.lua`` call: the releases first, then the checks in
    order) and to the memory store one after the other in that order."""
    admitted: list[tuple[list[str], str]] = []
    log: list[str] = []
    segment: list[Step] = []

    async def flush() -> None:
        # riders (releases and batched grants given back) go first, in order
        riders: list[tuple[list[str], str] | ReturnOp | QuotaReturnOp | GrantOp] = []
        for r in segment:
            if isinstance(r, Release) and admitted:
                riders.append(admitted[r.pick % len(admitted)])
            elif isinstance(r, GiveBack) and (back := _give_back(keys, limiters, r, clock.now)) is not None:
                riders.append(back)
        checks = [(f"r{len(log)}.{i}", _ops(keys, limiters, c, clock.now))
                  for i, c in enumerate(x for x in segment if isinstance(x, Check))]
        segment.clear()

        def ride(store: Store, rider: tuple[list[str], str] | ReturnOp | QuotaReturnOp | GrantOp
                 ) -> Awaitable[object]:
            if isinstance(rider, ReturnOp | QuotaReturnOp | GrantOp):
                return store.check([rider], "")
            return store.release(*rider)

        expected_released = [await ride(memory, r) for r in riders]
        expected = [await memory.check(ops, lease_id) for lease_id, ops in checks]
        answers = await asyncio.gather(*(ride(remote, r) for r in riders),
                                       *(remote.check(ops, lease_id) for lease_id, ops in checks))
        log.append(f"t={clock.now!r} riders {riders} checks {checks} -> {expected_released} {expected}")
        assert list(answers) == [*expected_released, *expected], "\n".join([*log, repr(answers)])
        admitted.extend(([op.key for op in ops if isinstance(op, LeaseOp)], lease_id)
                        for (lease_id, ops), res in zip(checks, expected, strict=True) if res.admitted)

    for step in steps:
        if isinstance(step, Check | Release | GiveBack):
            segment.append(step)
            continue
        await flush()
        if isinstance(step, Advance):
            gap = _gap(step.gap, limiters, 0.1) if step.gap != "expiry" else 0.5
            clock.advance(gap)
            log.append(f"advance {gap!r}")
    await flush()


@pytest.mark.redis
@DIFFERENTIAL
@given(timeline=timelines(grants=True))
def test_stores_agree_on_batched_grants(redis_up: RedisSingle,
                                        timeline: tuple[tuple[Limiter, ...], list[Step]]) -> None:
    """Grants (``GrantOp``, with a remainder given back) and give-backs (``ReturnOp``) beside
    buckets and leases, and a quota's grants (``QuotaGrantOp``) and give-backs
    (``QuotaReturnOp``) beside exact counts: the same answers from ``check.lua`` and the
    embedded store."""
    limiters, steps = timeline

    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        await _run([memory, remote], clock, keys, limiters, steps)

    _both(redis_up, body)


@pytest.mark.redis
@DIFFERENTIAL
@given(timeline=timelines(grants=True))
def test_stores_agree_when_grants_and_give_backs_share_script_calls(
        redis_up: RedisSingle, timeline: tuple[tuple[Limiter, ...], list[Step]]) -> None:
    """Give-backs ride with the checks of their batch (one merged ``check.lua`` call)."""
    limiters, steps = timeline

    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        await _run_batched(memory, remote, clock, keys, limiters, steps)

    _both(redis_up, body)


@pytest.mark.redis
@DIFFERENTIAL
@given(timeline=timelines())
def test_stores_agree_when_checks_and_releases_share_script_calls(
        redis_up: RedisSingle, timeline: tuple[tuple[Limiter, ...], list[Step]]) -> None:
    """A merged call keeps each key's state in the script after its first read (see
    check.lua): its requests must still get exactly the answers of one call each."""
    limiters, steps = timeline

    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        await _run_batched(memory, remote, clock, keys, limiters, steps)

    _both(redis_up, body)

SHED_PARAMS = (
    ShedParams(good_below=0.7, bad_above=0.8, delay_before_shedding=28, time_to_shed_all=120, ttl=300),
    ShedParams(good_below=0.6, bad_above=0.9, delay_before_shedding=7, time_to_shed_all=13, ttl=60),
    ShedParams(good_below=0.33, bad_above=0.34, delay_before_shedding=0.7, time_to_shed_all=3, ttl=60),
)
#: thresholds exactly, either side of them, and the ends
UTILIZATIONS = (0.0, 0.33, 0.34, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95, 1.0)


@pytest.mark.redis
@DIFFERENTIAL
@given(params=st.sampled_from(SHED_PARAMS),
       samples=st.lists(st.tuples(st.one_of(st.sampled_from((0.0, 1 / 7, 1.0, 8.0, 30.0)),
                                            st.floats(0.0, 40.0, allow_nan=False)),
                                  st.one_of(st.sampled_from(UTILIZATIONS), st.floats(0.0, 1.0))),
                        min_size=1, max_size=40))
def test_stores_agree_on_the_shed_controller(redis_up: RedisSingle, params: ShedParams,
                                             samples: list[tuple[float, float]]) -> None:
    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        key = keys.shed_state("w")
        levels: list[tuple[float, float]] = []
        for gap, utilization in samples:
            clock.advance(gap)
            pair = (await memory.shed_update(key, utilization, params),
                    await remote.shed_update(key, utilization, params))
            levels.append(pair)
            assert pair[0] == pair[1], levels
            assert params.resting <= pair[0] <= 1.0

    _both(redis_up, body)


# --------------------------------------------------------------------------- keyed limiters


KEYED_POLICY = {
    "identity": [{"header": "x-api-key"}, {"source_ip": True}],
    "plan": {"from": [{"header": "x-plan"}], "default": "free"},
    "limiters": [
        {"name": "per-ip", "type": "request_rate", "rate": 0.7, "burst": 2.3, "key": [{"source_ip": True}]},
        {"name": "per-org", "type": "request_rate", "rate": 1 / 3, "burst": 1.7, "cost": 0.7,
         "key": [{"header": "x-org"}], "on_missing_key": "shared"},
        {"name": "per-user-method", "type": "concurrent_requests", "limit": 2,
         "key": [{"identity": True}, {"method": True}], "mode": "shadow"},
        {"name": "per-org-quota", "type": "quota", "limit": 3, "period": "minute",
         "key": [{"header": "x-org"}, {"plan": True}], "plans": {"pro": {"limit": 5}}},
    ],
}


@st.composite
def keyed_requests(draw: st.DrawFn) -> list[tuple[float, RawRequest]]:
    out = []
    for _ in range(draw(st.integers(5, 40))):
        gap = draw(st.sampled_from((0.0, 0.0, 1 / 7, 1.0, 10 / 7, 30.0)))
        headers = {"x-api-key": draw(st.sampled_from(("sk_a", "sk_b", "sk_c")))}
        org = draw(st.sampled_from(("", "acme", "initech")))
        if org:
            headers["x-org"] = org
        if draw(st.booleans()):
            headers["x-plan"] = "pro"
        out.append((gap, RawRequest(draw(st.sampled_from(("GET", "POST"))), "/v1/x", headers=headers,
                                    source_ip=draw(st.sampled_from(("10.0.0.1", "10.0.0.2"))))))
    return out


@pytest.mark.redis
@DIFFERENTIAL
@given(requests=keyed_requests())
def test_engines_agree_on_keyed_limiters_and_quotas(redis_up: RedisSingle, tmp_path_factory: pytest.TempPathFactory,
                                                    requests: list[tuple[float, RawRequest]]) -> None:
    """The engine's decisions for keyed limiters (a missing key skipped or shared) and a
    quota with plans are the same on the embedded store and Redis."""
    policy = policy_from(tmp_path_factory.mktemp("keyed"), KEYED_POLICY)

    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        engines = [Engine(StoreGate(s, clock=clock, deadline=5.0), policy, keys=keys) for s in (memory, remote)]
        log: list[str] = []
        for gap, raw in requests:
            clock.advance(gap)
            answers = [(await e.check(raw))[1] for e in engines]
            log.append(f"t={clock.now!r} {raw.method} {dict(raw.headers)} {raw.source_ip} -> {answers[0]}")
            strip = [dataclasses.replace(d, lease_id="") for d in answers]
            assert strip[0] == strip[1], "\n".join(log)

    _both(redis_up, body)


# --------------------------------------------------------------------------- fleet grants


@dataclass(frozen=True)
class FleetStep:
    """One step of a fleet key shared by replicas holding grants (``FleetGrantOp``) and
    exact leases: ``grow`` (want > 0), ``renew`` (want 0), ``shrink`` (want < 0), ``lease``
    (an exact LeaseOp), ``release`` (of an exact lease) or ``advance`` (gap)."""

    what: str
    replica: int
    amount: int
    gap: float


#: grant TTLs: below, at and above the gaps
GRANT_TTLS = (1 / 7, 0.3, 1.0)


@st.composite
def fleet_timelines(draw: st.DrawFn) -> tuple[int, float, float, list[FleetStep]]:
    limit = draw(st.sampled_from((0, 1, 3, 7)))
    ttl = draw(st.sampled_from(GRANT_TTLS))
    lease_ttl = draw(st.sampled_from(LEASE_TTLS))
    steps = draw(st.lists(st.builds(
        FleetStep, st.sampled_from(("grow", "grow", "renew", "shrink", "lease", "release", "advance")),
        st.integers(0, 2), st.integers(1, 4), st.sampled_from((*GAPS, "ttl"))), min_size=1, max_size=30))
    return limit, ttl, lease_ttl, [dataclasses.replace(x, gap=ttl if x.gap == "ttl" else x.gap) for x in steps]


def _fleet_op(key: str, limit: int, ttl: float, lease_ttl: float, step: FleetStep, have: int,
              enforce: bool) -> Op:
    """The op of a ``lease``, ``grow``, ``renew`` or ``shrink`` step, the replica's grant
    holding ``have`` slots."""
    if step.what == "lease":
        return LeaseOp(key, limit, lease_ttl, enforce)
    want = {"grow": step.amount, "renew": 0, "shrink": -step.amount}[step.what]
    # the slots in use: any of them (restored if expired)
    return FleetGrantOp(key, limit, ttl, f"g{step.replica}", have, want, enforce and want > 0,
                        used=step.amount % (have + 1))


@pytest.mark.redis
@DIFFERENTIAL
@given(timeline=fleet_timelines(), enforce=st.booleans())
def test_stores_agree_on_fleet_grants(redis_up: RedisSingle, timeline: tuple[int, float, float, list[FleetStep]],
                                      enforce: bool) -> None:
    """Fleet slots held as grants (``FleetGrantOp``: grow, renew, shrink; members that
    expire when not renewed) by three replicas beside exact leases on the same key: the
    same answers and live counts from ``check.lua`` and the embedded store, and the key
    never holds more than ``limit`` live members through grants (a growth adds only what
    is left)."""
    limit, ttl, lease_ttl, steps = timeline

    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        key = keys.fleet_leases("f", "other")
        have = [0, 0, 0]
        exact: list[str] = []
        log: list[str] = []
        for n, step in enumerate(steps):
            if step.what == "advance":
                clock.advance(step.gap)
                log.append(f"advance {step.gap!r}")
                continue
            if step.what == "release":
                if exact:
                    lease_id = exact.pop(step.amount % len(exact))
                    counts = [await s.release([key], lease_id) for s in (memory, remote)]
                    log.append(f"release {lease_id} -> {counts}")
                    assert counts[0] == counts[1], "\n".join(log)
                continue
            op = _fleet_op(key, limit, ttl, lease_ttl, step, have[step.replica], enforce)
            before = (await memory.inflight([key]))[0]
            results = [await s.check([op], f"x{n}") for s in (memory, remote)]
            log.append(f"t={clock.now!r} {op} -> {results[0]}")
            assert results[0] == results[1], "\n".join([*log, repr(results)])
            live = await memory.inflight([key])
            assert live == await remote.inflight([key]), "\n".join(log)
            if isinstance(op, FleetGrantOp):
                if results[0].results[0].extra >= 0:  # -1: nothing committed
                    have[step.replica] = int(results[0].results[0].extra)
                if limit > 0:  # never a free slot past limit; the slots in use are kept
                    assert live[0] <= max(limit, before + op.used), "\n".join(log)
                    res = results[0].results[0]
                    if results[0].admitted and res.allowed:  # committed: the leases past limit
                        assert res.retry_after == max(0, live[0] - limit), "\n".join(log)
            elif results[0].admitted:
                exact.append(f"x{n}")

    _both(redis_up, body)


# --------------------------------------------------------------------------- ledger slices


@dataclass(frozen=True)
class SliceStep:
    """One step of a quota ledger shared by holders (``SliceOp``): ``take`` (ask ``amount``
    units), ``renew`` (ask what the holder has), ``give`` (ask 0) or ``advance`` (gap)."""

    what: str
    holder: int
    amount: int
    gap: float


@st.composite
def slice_timelines(draw: st.DrawFn) -> tuple[int, float, list[SliceStep]]:
    total = draw(st.sampled_from((0, 1, 3, 7, 20)))
    ttl = draw(st.sampled_from(GRANT_TTLS))
    steps = draw(st.lists(st.builds(
        SliceStep, st.sampled_from(("take", "take", "renew", "give", "advance")),
        st.integers(0, 3), st.integers(0, 9), st.sampled_from((*GAPS, "ttl"))), min_size=1, max_size=30))
    return total, ttl, [dataclasses.replace(x, gap=ttl if x.gap == "ttl" else x.gap) for x in steps]


def _slice_op(key: str, total: int, ttl: float, step: SliceStep, have: int) -> SliceOp:
    want = {"take": step.amount, "renew": have, "give": 0}[step.what]
    return SliceOp(key, total, ttl, f"h{step.holder}", want)


@pytest.mark.redis
@DIFFERENTIAL
@given(timeline=slice_timelines(), lowered=st.integers(0, 3))
def test_stores_agree_on_ledger_slices(redis_up: RedisSingle, timeline: tuple[int, float, list[SliceStep]],
                                       lowered: int) -> None:
    """Slices of one ledger (``SliceOp``) taken, renewed and given back by four holders,
    some expiring: the same answers from ``check.lua`` and the embedded store, and the live
    slices never sum past ``total`` (the second half of a timeline runs with ``total``
    lowered by ``lowered``: the slices taken before it shrink as they are renewed)."""
    total, ttl, steps = timeline

    async def body(memory: Store, remote: Store, clock: ManualClock, keys: Keys) -> None:
        assert isinstance(memory, MemoryStore)
        key = keys.quota_ledger("q", "b0", "fill")
        have: dict[int, tuple[int, float]] = {}  # holder -> (slice, expires at)
        log: list[str] = []
        for n, step in enumerate(steps):
            if step.what == "advance":
                clock.advance(step.gap)
                log.append(f"advance {step.gap!r}")
                continue
            now_total = total if n < len(steps) // 2 else max(0, total - lowered)
            mine, until = have.get(step.holder, (0, 0.0))
            op = _slice_op(key, now_total, ttl, step, mine if until > clock.now else 0)
            others = sum(s for h, (s, at) in have.items() if h != step.holder and at > clock.now)
            results = [await s.check([op], f"x{n}") for s in (memory, remote)]
            log.append(f"t={clock.now!r} {op} -> {results[0]}")
            assert results[0] == results[1], "\n".join([*log, repr(results)])
            res = results[0].results[0]
            assert res.allowed and results[0].admitted
            assert res.extra == algorithms.slice_top(others, op), "\n".join(log)
            have[step.holder] = (int(res.extra), clock.now + ttl)
            live = memory.slices(key)
            assert sum(live.values()) == others + res.extra, "\n".join(log)
            if others <= now_total:  # never past the total by a slice taken under it
                assert sum(live.values()) <= now_total, "\n".join(log)

    _both(redis_up, body)


# --------------------------------------------------------------------------- every op kind


def _check_ops(limiter: Limiter) -> list[Op]:
    """The ops a timeline's check of ``limiter`` sends."""
    return _ops(Keys("kinds"), [limiter], Check(0, ((0, True, 1.0),)), START)


def _give_back_ops(drawn: tuple[Limiter, GiveBack]) -> list[Op]:
    """The op a timeline's give-back step sends for ``limiter`` (none for some limiters)."""
    back = _give_back(Keys("kinds"), [drawn[0]], drawn[1], START)
    return [] if back is None else [back]


def _fleet_ops(drawn: tuple[tuple[int, float, float, list[FleetStep]], bool]) -> list[Op]:
    """The ops of a fleet timeline's first steps (each replica's grant still empty)."""
    (limit, ttl, lease_ttl, steps), enforce = drawn
    key = Keys("kinds").fleet_leases("f", "other")
    return [_fleet_op(key, limit, ttl, lease_ttl, step, 0, enforce) for step in steps
            if step.what not in ("advance", "release")]


def _slice_ops(drawn: tuple[int, float, list[SliceStep]]) -> list[Op]:
    """The ops of a ledger timeline's steps (each holder's slice still empty)."""
    total, ttl, steps = drawn
    key = Keys("kinds").quota_ledger("q", "b0", "fill")
    return [_slice_op(key, total, ttl, step, 0) for step in steps if step.what != "advance"]


#: op kind -> the ops this file's timelines send, drawn from the same generators: every kind
#: of ``extauthz.store.base.OP_KINDS`` needs one that makes it (tests/store/test_op_table.py),
#: so that a new op kind is compared on both stores here
GENERATORS: dict[type[Op], st.SearchStrategy[list[Op]]] = {
    **{kind: limiter.map(_check_ops) for kind, limiter in _limiters(0).items()},
    ReturnOp: st.tuples(_limiters(0)[GrantOp], GIVE_BACKS).map(_give_back_ops),
    QuotaReturnOp: st.tuples(_limiters(0)[QuotaGrantOp], GIVE_BACKS).map(_give_back_ops),
    FleetGrantOp: st.tuples(fleet_timelines(), st.booleans()).map(_fleet_ops),
    SliceOp: slice_timelines().map(_slice_ops),
}
