"""The quota ledger's marker (docs/rlqs.md "A store that loses its data"): a store that loses
its data (a Redis restarted empty: ``FLUSHALL`` on a real Redis here, ``flushall`` on the
embedded store) loses the ledger while the Envoys enforce what they were sent. Every replica
finds its own marker gone at its next settle (read in the same store call) and grows no share
until every assignment sent before the loss has run out and cooled; a replica that has not
called since reads the reset flag. Everything on one injected clock."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import pytest
from hypothesis import HealthCheck, Phase, find, settings

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import (
    NOTHING,
    SLICE_MARGIN_REPORTS,
    QuotaBook,
    QuotaLimit,
    Share,
    StoreLedger,
    Usage,
)
from extauthz.server.services import quota_metrics
from extauthz.store.base import BucketOp, ShedParams, Store
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from testinfra.probes import flushall, key_count
from testinfra.quota_envoy import BUCKET, World, drawn, established, wiped_ledger
from testinfra.redis_servers import RedisSingle
from tests.store.conftest import make_redis_store
from tests.store.test_differential import GENERATORS

LIMIT = QuotaLimit(2.0, 4.0)
KEY = tuple(sorted(BUCKET.items()))


@dataclass
class Case:
    store: Store
    clock: ManualClock
    wipe: Callable[[], None]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def case(request: pytest.FixtureRequest) -> AsyncIterator[Case]:
    clock = ManualClock(0.0)
    if request.param == "memory":
        memory = MemoryStore(clock)
        yield Case(memory, clock, partial(flushall, memory))
        return
    topology: RedisSingle = request.getfixturevalue("redis_single_clean")
    store = make_redis_store(topology, clock)
    try:
        yield Case(store, clock, topology.flushall)
    finally:
        await store.close()


def book(case: Case, name: str) -> QuotaBook:
    return QuotaBook(lambda: {"per-ip": LIMIT}, clock=case.clock,
                     ledger=StoreLedger(case.store, Keys(prefix="mark"), replica=name))


def freeze(b: QuotaBook) -> float:
    """How long a replica that found the ledger lost grows nothing: the slices' TTL (the
    assignments' and their way) and the longest cooling tail (a holder's fill is at least 1)."""
    return b.ttl + SLICE_MARGIN_REPORTS * b.report_interval + LIMIT.total.burst * LIMIT.interval


async def first(b: QuotaBook, stream: object, elapsed: float = 0.0, denied: int = 1) -> Share | None:
    out = await b.settle(b.report(stream, "d", [Usage(BUCKET, elapsed, 0, denied)]))  # type: ignore[arg-type]
    return out[stream.id][0].share  # type: ignore[attr-defined]


async def test_every_replica_finds_the_ledger_lost_and_grows_nothing_until_its_assignments_ran_out(
        case: Case) -> None:
    await case.store.check(established(Keys(prefix="mark")), "")
    a, b = book(case, "a"), book(case, "b")
    sa, sb = a.open("envoy-a"), b.open("envoy-b")
    assert await first(a, sa) == LIMIT.total  # a's Envoy holds the whole limit
    assert await first(b, sb) == NOTHING  # nothing free for b's
    case.wipe()  # the store restarts empty: a's Envoy still enforces the whole limit
    case.clock.advance(5.0)
    # b settles first: the store has everything free, but b's marker is gone
    assert await first(b, sb, 5.0, 50) == NOTHING
    assert b.ledger_resets == 1 and b.status()["ledger"]["resets"] == 1  # type: ignore[index]
    families = {f.name: f for f in quota_metrics(b)}
    assert families["extauthz_quota_ledger_resets"].samples[0].value == 1
    # a finds its own marker gone too (its share renewed at most at its size)
    await first(a, sa, 5.0, 0)
    assert a.ledger_resets == 1
    lost_at = case.clock.monotonic()
    granted_at = None
    for _ in range(12):
        case.clock.advance(5.0)
        await first(a, sa, 5.0, 0)  # a's Envoy goes quiet (its demand falls, its share shrinks)
        share = await first(b, sb, 5.0, 50)
        if share not in (None, NOTHING) and granted_at is None:
            granted_at = case.clock.monotonic()
    assert granted_at is not None  # b's Envoy gets a share once the freeze is over
    assert granted_at >= lost_at - 5.0 + freeze(b)
    assert b.ledger_resets == 1  # one loss, counted once


async def test_a_replica_that_did_not_call_since_the_loss_reads_the_reset_flag(case: Case) -> None:
    await case.store.check(established(Keys(prefix="mark")), "")
    a = book(case, "a")
    sa = a.open("envoy-a")
    assert await first(a, sa) == LIMIT.total
    case.wipe()
    case.clock.advance(5.0)
    await first(a, sa, 5.0, 0)  # a finds the loss (and writes its marker anew)
    assert a.ledger_resets == 1
    # a new replica's first call: a's marker is there (so not a new store), and the flag
    c = book(case, "c")
    sc = c.open("envoy-c")
    assert await first(c, sc) == NOTHING
    assert c.status()["ledger"]["flagged"] is True  # type: ignore[index]
    assert c.ledger_resets == 0  # its own marker was never lost


async def test_a_new_store_grows_nothing_for_two_report_intervals_and_a_used_one_at_once(case: Case) -> None:
    a = book(case, "a")
    sa = a.open("envoy-a")
    assert await first(a, sa) == NOTHING  # no replica's marker: maybe a store that lost its data
    assert a.ledger_resets == 0
    case.clock.advance(2 * a.report_interval)
    assert await first(a, sa, 5.0) == LIMIT.total
    # a replica restarted on that store: the marker of its predecessor is there
    b = book(case, "b")
    sb = b.open("envoy-b")
    case.clock.advance(b.ttl * 3)  # a's slices long expired (its marker lives a day)
    assert await first(b, sb) == LIMIT.total


async def test_a_moved_envoy_on_a_new_store_makes_it_a_loss(case: Case) -> None:
    """A replica's first call finds no marker and a stream reports a bucket with time elapsed
    (an Envoy that held it from a replica before this store lost its data): a loss."""
    a = book(case, "a")
    sa = a.open("envoy-a")
    assert await first(a, sa, 5.0, 3) == NOTHING
    assert a.ledger_resets == 1
    case.clock.advance(2 * a.report_interval)
    assert await first(a, sa, 5.0) == NOTHING  # still frozen
    case.clock.advance(freeze(a))
    assert await first(a, sa, 5.0) == LIMIT.total


@pytest.mark.parametrize("seed", [4, 18, 57])
async def test_three_replicas_keep_the_promise_through_wipes(case: Case, seed: int) -> None:
    """``wiped_ledger`` on the store (a real Redis FLUSHALL at random ticks): timelines that
    went past rate x t + burst without the marker (tests/fuzz/test_fuzz_quota.py pins them)."""
    rng, limit, envoys = drawn(seed)
    world = World(rng, envoys, *limit, replicas=3, store=case.store, clock=case.clock, keys=Keys(prefix=f"w{seed}"),
                  wipe=case.wipe)
    await wiped_ledger(world, envoys)
    assert world.wiped and world.admitted
    assert world.worst_excess(*limit) <= 1e-6


def test_the_marker_ops_decode_on_their_own() -> None:
    """The probe and renewal answers: own marker there or not, others', the flag."""
    clock = ManualClock(0.0)
    store = MemoryStore(clock)
    ledger = StoreLedger(store, Keys(), replica="x")
    marked = ledger.marked_by(*store.check_now(ledger.marker_ops(), "").results)
    assert marked.fresh and not marked.lost and not marked.reset
    marked = ledger.marked_by(*store.check_now(ledger.marker_ops(), "").results)
    assert not marked.fresh and not marked.lost and not marked.reset
    store.check_now(established(Keys(), "y"), "")
    store.check_now(established(Keys(), "z"), "")
    marked = ledger.marked_by(*store.check_now(ledger.marker_ops(), "").results)
    assert not marked.fresh and not marked.lost and not marked.reset
    flushall(store)
    store.check_now(established(Keys(), "y"), "")
    marked = ledger.marked_by(*store.check_now(ledger.marker_ops(), "").results)
    assert marked.lost and marked.reset


#: the memory store's tables that are its wiring, not data (FLUSHALL keeps them)
WIRING = {"_read", "_write", "_kinds"}


def _tables(store: MemoryStore) -> dict[str, object]:
    """Every container the embedded store holds (sets in a tuple flattened), wiring aside."""
    out: dict[str, object] = {}
    for name, value in vars(store).items():
        if name in WIRING:
            continue
        if isinstance(value, tuple) and all(isinstance(v, set) for v in value):
            value = set().union(*value)
        if isinstance(value, dict | list | set | deque):
            out[name] = value
    return out


async def test_the_wipe_leaves_the_embedded_store_holding_nothing() -> None:
    """``testinfra.probes.flushall`` (the tests' FLUSHALL of the embedded store) empties every
    table the store has, a table added later included: a key it missed would survive the
    "Redis restarted empty" of the tests above."""
    clock = ManualClock(1000.0)
    store = MemoryStore(clock, max_keys=1)
    keys = Keys()
    for kind, ops in GENERATORS.items():
        found = find(ops, lambda drawn, kind=kind: any(type(op) is kind for op in drawn),
                     settings=settings(max_examples=500, database=None, phases=[Phase.generate],
                                       suppress_health_check=list(HealthCheck)))
        store.check_now(found, "lease")
    user = keys.bucket("per-user", "alice"), keys.bucket("per-user", "bob")
    for key in user:  # per-user keys of one limiter, past its bound: held and evicted
        store.check_now([BucketOp(key, 1.0, 10.0, 1.0)], "")
    store.check_now(established(keys, "y"), "")  # a quota ledger's slices
    await store.set_value("v", "1", ttl=60.0)
    await store.shed_update("shed", 0.9, ShedParams(0.5, 0.8, 1.0, 10.0, 60.0))
    await store.append_events("events", ["e"], maxlen=10, ttl=60.0)
    before = _tables(store)
    assert {name for name, table in before.items() if table} >= {
        "_buckets", "_leases", "_slices", "_values", "_shed", "_events", "_held", "evictions", "_scheduled"}
    flushall(store)
    assert {name: table for name, table in _tables(store).items() if table} == {}
    assert key_count(store) == 0
