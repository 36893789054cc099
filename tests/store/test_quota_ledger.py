"""The quota service's ledger in the store (issue 33; extauthz/engine/quota_service.py
``StoreLedger`` and ``QuotaBook.settle``): two replicas' books on one store (the embedded
store and a real Redis, on one injected clock) never assign shares that, in force at their
Envoys together, sum past the limiter's rate and burst; a restarted replica honours what the
store holds; a store that does not answer sends nothing (never more)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from extauthz.core.clock import ManualClock
from extauthz.core.errors import StoreUnavailable
from extauthz.engine.quota_service import (
    NOTHING,
    Action,
    Granted,
    Hold,
    QuotaBook,
    QuotaLimit,
    Share,
    StoreLedger,
    Stream,
    Usage,
    cool_tail,
)
from extauthz.store.base import CheckResult, Op, SliceOp, Store
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from extauthz.store.redis import RedisStore
from testinfra.quota_envoy import established
from testinfra.redis_servers import RedisCluster, RedisSingle
from tests.store.conftest import TOPOLOGY_FIXTURES, make_redis_store

LIMIT = QuotaLimit(rate=10, burst=20)
LIMITS = {"per-ip": LIMIT}
BUCKETS = [{"limiter": "per-ip", "ip": f"10.0.0.{n}"} for n in (1, 2)]


@dataclass
class Case:
    store: Store
    clock: ManualClock


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
async def case(request: pytest.FixtureRequest) -> AsyncIterator[Case]:
    """The embedded store, a real Redis, and a real Redis Cluster (a bucket's three ledger
    keys share one hash tag: one atomic call)."""
    clock = ManualClock()
    if request.param == "memory":
        memory = MemoryStore(clock)
        memory.check_now(established(Keys()), "")
        yield Case(memory, clock)
        return
    topology: RedisSingle | RedisCluster = request.getfixturevalue(TOPOLOGY_FIXTURES[request.param])
    store = make_redis_store(topology, clock)
    try:
        await store.check(established(Keys()), "")
        yield Case(store, clock)
    finally:
        await store.close()


def book(case: Case, name: str) -> QuotaBook:
    return QuotaBook(lambda: LIMITS, clock=case.clock, ledger=StoreLedger(case.store, Keys(), replica=name))


class Envoys:
    """What the Envoys enforce: per (replica, stream, bucket) the last share sent and when
    its assignment expires (Envoy keeps it until its TTL, whatever happens to the server)."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.held: dict[tuple[str, int, tuple[tuple[str, str], ...]], tuple[Share, float]] = {}

    def apply(self, replica: str, out: dict[int, list[Action]], ttl: float) -> None:
        for sid, actions in out.items():
            for action in actions:
                where = (replica, sid, action.bucket)
                if action.share is None or action.deny:
                    self.held.pop(where, None)
                else:
                    self.held[where] = (action.share, self.clock.monotonic() + ttl)

    def in_force(self, bucket: tuple[tuple[str, str], ...]) -> Share:
        now = self.clock.monotonic()
        live = [s for (_, _, b), (s, until) in self.held.items() if b == bucket and until > now]
        return Share(sum(s.fill for s in live), sum(s.burst for s in live))


async def report(b: QuotaBook, name: str, envoys: Envoys, stream: Stream, usages: Sequence[Usage]) -> None:
    envoys.apply(name, await b.settle(b.report(stream, "d", usages)), b.ttl)


async def test_two_replicas_never_assign_past_the_limit_random(case: Case) -> None:
    rnd = random.Random(33)
    names = ["a", "b"]
    books = {n: book(case, n) for n in names}
    envoys = Envoys(case.clock)
    streams: list[tuple[str, Stream]] = []
    keys = [tuple(sorted(b.items())) for b in BUCKETS]
    total = LIMIT.total
    assigned = 0
    for _ in range(300):
        move = rnd.random()
        if move < 0.1 or not streams:
            name = rnd.choice(names)
            streams.append((name, books[name].open("peer")))
        elif move < 0.15:
            name, stream = streams.pop(rnd.randrange(len(streams)))
            books[name].close(stream)
        elif move < 0.2:  # a replica restarts: a new book (and ledger holder name), same store
            name = rnd.choice(names)
            restarted = f"{name}'"
            books[restarted] = book(case, restarted)
            names[names.index(name)] = restarted
            streams = [(n, s) for n, s in streams if n != name]
        elif move < 0.35:
            case.clock.advance(rnd.choice([0.5, 1.0, 2.5, 5.0, 9.0]))
        else:
            name, stream = rnd.choice(streams)
            usages = [Usage(b, rnd.choice([0.0, 5.0]), rnd.randint(0, 40), rnd.randint(0, 40))
                      for b in rnd.sample(BUCKETS, rnd.randint(1, 2))]
            await report(books[name], name, envoys, stream, usages)
        for key in keys:
            held = envoys.in_force(key)
            assert held.fill <= total.fill and held.burst <= total.burst, (key, held, envoys.held)
            assigned = max(assigned, held.fill)
    assert assigned > 0  # the timeline assigned something


async def test_a_restarted_replica_honours_what_the_store_holds(case: Case) -> None:
    old = book(case, "old")
    envoys = Envoys(case.clock)
    first = old.open("envoy-1")
    await report(old, "old", envoys, first, [Usage(BUCKETS[0], 0.0, 0, 1)])
    key = tuple(sorted(BUCKETS[0].items()))
    assert envoys.in_force(key) == LIMIT.total  # one stream: the whole limit
    # the replica restarts (its book is gone, its Envoy keeps its assignment until the TTL)
    new = book(case, "new")
    second = new.open("envoy-2")
    await report(new, "new", envoys, second, [Usage(BUCKETS[0], 0.0, 0, 1)])
    assert envoys.held[("new", second.id, key)][0] == NOTHING  # early refusal, not over-admission
    assert envoys.in_force(key) == LIMIT.total
    status = new.status()
    bucket = status["streams"][0]["buckets"][0]  # type: ignore[index]
    assert bucket["store"] == {"fill": 0, "burst": 0, "free": {"fill": 0, "burst": 0}, "others_demand": 0.0}
    # the old slices pass their TTL (the assignment's plus one report interval) and the time
    # their fill takes to refill their burst (its Envoy may have spent it): the whole limit
    case.clock.advance(old.ttl + old.report_interval + cool_tail(LIMIT.total, LIMIT.interval))
    await report(new, "new", envoys, second, [Usage(BUCKETS[0], 5.0, 0, 3)])
    assert envoys.held[("new", second.id, key)][0] == LIMIT.total


async def test_an_abandoned_bucket_s_slices_go_back_after_their_ttl(case: Case) -> None:
    a, b = book(case, "a"), book(case, "b")
    envoys = Envoys(case.clock)
    sa, sb = a.open("envoy-a"), b.open("envoy-b")
    key = tuple(sorted(BUCKETS[0].items()))
    await report(a, "a", envoys, sa, [Usage(BUCKETS[0], 0.0, 0, 1)])
    await report(b, "b", envoys, sb, [Usage(BUCKETS[0], 0.0, 0, 1)])
    assert envoys.held[("b", sb.id, key)][0] == NOTHING  # a holds the whole limit
    # a's bucket goes idle: abandoned after IDLE_REPORTS reports
    for _ in range(6):
        case.clock.advance(5.0)
        await report(a, "a", envoys, sa, [Usage(BUCKETS[0], 5.0, 0, 0)])
    assert ("a", sa.id, key) not in envoys.held
    # a's Envoy enforces its last assignment until the abandon reaches it: its slices stay
    # until their TTL (the assignment's plus one report interval) and their cooling, then b
    # takes the limit
    await report(b, "b", envoys, sb, [Usage(BUCKETS[0], 5.0, 0, 9)])
    assert envoys.held[("b", sb.id, key)][0] == NOTHING
    case.clock.advance(a.ttl + a.report_interval + cool_tail(LIMIT.total, LIMIT.interval))
    await report(b, "b", envoys, sb, [Usage(BUCKETS[0], 5.0, 0, 9)])
    assert envoys.held[("b", sb.id, key)][0] == LIMIT.total


async def test_replicas_share_by_demand(case: Case) -> None:
    """A takes the whole limit first; B's Envoy then asks as much: within a few reports A
    shrinks to its part of the demand across both replicas (confirmed by its next report)
    and B grows into what A gave back; never past the limit on the way."""
    a, b = book(case, "a"), book(case, "b")
    envoys = Envoys(case.clock)
    sa, sb = a.open("envoy-a"), b.open("envoy-b")
    key = tuple(sorted(BUCKETS[0].items()))
    await report(a, "a", envoys, sa, [Usage(BUCKETS[0], 0.0, 0, 1)])
    await report(b, "b", envoys, sb, [Usage(BUCKETS[0], 0.0, 0, 1)])
    assert envoys.held[("a", sa.id, key)][0] == LIMIT.total
    for _ in range(5):
        case.clock.advance(5.0)
        await report(a, "a", envoys, sa, [Usage(BUCKETS[0], 5.0, 50, 0)])
        await report(b, "b", envoys, sb, [Usage(BUCKETS[0], 5.0, 0, 50)])
        held = envoys.in_force(key)
        assert held.fill <= LIMIT.total.fill and held.burst <= LIMIT.total.burst
    sent_a, sent_b = envoys.held[("a", sa.id, key)][0], envoys.held[("b", sb.id, key)][0]
    assert sent_b.fill >= LIMIT.total.fill // 2 - 1 and sent_a.fill >= LIMIT.total.fill // 2 - 1, (sent_a, sent_b)
    bucket = b.status()["streams"][0]["buckets"][0]  # type: ignore[index]
    assert bucket["store"]["others_demand"] == 10.0  # a's 50 requests in 5 s


async def test_holders_asking_at_once_share_exactly_the_total(case: Case) -> None:
    """Atomicity: 20 holders each ask 3 of 10 units at once (one store call each, concurrent
    on Redis): exactly 10 are granted, and every holder asking again gets what it holds."""
    ops = [SliceOp(Keys().quota_ledger("per-ip", "b", "fill"), 10, 15.0, f"h{n}", 3) for n in range(20)]
    results = await asyncio.gather(*(case.store.check([op], "") for op in ops))
    granted = [int(r.results[0].extra) for r in results]
    assert sum(granted) == 10, granted
    again = await asyncio.gather(*(case.store.check([op], "") for op in ops))
    assert [int(r.results[0].extra) for r in again] == granted


class Failing(MemoryStore):
    """The embedded store, with its check failing while ``down`` (a store outage)."""

    down = False

    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        if self.down:
            raise StoreUnavailable("store down")
        return await super().check(ops, lease_id)


async def test_a_store_outage_sends_nothing_more() -> None:
    clock = ManualClock()
    store = Failing(clock)
    store.check_now(established(Keys()), "")
    b = QuotaBook(lambda: LIMITS, clock=clock, ledger=StoreLedger(store, Keys(), replica="r"))
    envoys = Envoys(clock)
    s1 = b.open("envoy-1")
    await report(b, "r", envoys, s1, [Usage(BUCKETS[0], 0.0, 0, 1)])
    key = tuple(sorted(BUCKETS[0].items()))
    sent = envoys.held[("r", s1.id, key)]
    store.down = True
    clock.advance(5.0)
    s2 = b.open("envoy-2")
    out = await b.settle(b.report(s2, "d", [Usage(BUCKETS[0], 0.0, 0, 1)]))
    assert out == {}  # no assignment (no renewal, no new share): Envoy's TTL runs out, then DENY_ALL
    assert b.ledger is not None and b.ledger.failures > 0 and not b.ledger.healthy
    assert envoys.held[("r", s1.id, key)] == sent
    assert b.status()["ledger"] == {"replica": "r", "failures": b.ledger.failures, "healthy": False,
                                    "resets": 0, "frozen_for": 0.0, "flagged": False}
    store.down = False
    clock.advance(5.0)
    out = await b.settle(b.report(s2, "d", [Usage(BUCKETS[0], 5.0, 0, 5)]))
    envoys.apply("r", out, b.ttl)
    assert b.ledger.healthy
    held = envoys.in_force(key)
    assert held.fill <= LIMIT.total.fill and held.burst <= LIMIT.total.burst


def test_the_memory_store_forgets_a_ledger_once_its_slices_expire() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    key = Keys().quota_ledger("per-ip", "b", "fill")
    store.check_now([SliceOp(key, 10, 15.0, "h1", 4), SliceOp(key, 10, 20.0, "h2", 4)], "")
    assert store.slices(key) == {"h1": 4, "h2": 4}
    clock.advance(15.0)
    store.check_now([], "")  # a check sweeps what is due
    assert store._slices[key] == {"h2": (4, clock.monotonic() + 5.0)}
    clock.advance(5.0)
    store.check_now([], "")
    assert key not in store._slices


async def test_a_report_of_many_buckets_settles_in_few_store_calls(case: Case) -> None:
    """300 buckets in one report: settled in one store call per 128 (each bucket's three
    slices atomic; on Redis Cluster one call per bucket, as its store splits a call by hash
    tag anyway), each granted the whole limit; a second replica's stream then gets nothing
    of any of them."""
    buckets = [{"limiter": "per-ip", "ip": f"10.1.{n // 256}.{n % 256}"} for n in range(300)]
    a, b = book(case, "a"), book(case, "b")
    assert a.ledger is not None
    calls = 0
    check = case.store.check

    async def counted(ops: Sequence[Op], lease_id: str) -> CheckResult:
        nonlocal calls
        calls += 1
        return await check(ops, lease_id)

    case.store.check = counted  # type: ignore[method-assign]
    sa, sb = a.open("envoy-a"), b.open("envoy-b")
    out = await a.settle(a.report(sa, "d", [Usage(x, 0.0, 0, 1) for x in buckets]))
    # 128 + 128 + 44 (the marker's ops beside the first); on a cluster one per bucket and the marker's
    per_report = 301 if case.store.per_master else 3
    assert calls == per_report
    assert [action.share for action in out[sa.id]] == [LIMIT.total] * 300
    out = await b.settle(b.report(sb, "d", [Usage(x, 0.0, 0, 1) for x in buckets]))
    assert calls == 2 * per_report
    assert {action.share for action in out[sb.id]} == {NOTHING}


@pytest.mark.redis
async def test_a_dead_cluster_master_fails_only_the_holds_of_its_own_buckets(
        redis_cluster_clean: RedisCluster) -> None:
    """A report of 40 buckets on a Redis Cluster with one master down: the buckets whose
    ledger keys the live masters serve are answered; only the dead master's are not (their
    Envoys keep their last assignment until its TTL), not every bucket of the report."""
    cluster = redis_cluster_clean
    url = "redis+cluster://" + ",".join(f"{cluster.host}:{port}" for port in cluster.ports)
    buckets = [{"limiter": "per-ip", "ip": f"10.2.0.{n}"} for n in range(40)]
    keys = [tuple(sorted(b.items())) for b in buckets]
    probe = RedisStore.from_url(url)
    try:
        await probe.ping()
        assert isinstance(probe.client, AsyncRedisCluster)
        # not the client's default node: redis-py's cluster client starts only when it answers
        default = probe.client.get_default_node().name
        ledger = StoreLedger(probe, Keys(), replica="probe")
        node = {key: probe.node_of(ledger.ops(key, 1, NOTHING, LIMIT.total, 1.0, 0)[0].key) for key in keys}
    finally:
        await probe.close()
    dead = next(name for name in node.values() if name != default)
    assert 0 < sum(name == dead for name in node.values()) < len(keys)
    # quick: past cluster-node-timeout (2 s) the cluster would refuse every slot
    cluster.nodes[cluster.ports.index(int(dead.rsplit(":", 1)[1]))].kill()
    store = RedisStore.from_url(url)
    try:
        b = QuotaBook(lambda: LIMITS, clock=ManualClock(), ledger=StoreLedger(store, Keys(), replica="a"))
        s = b.open("envoy")
        out = await b.settle(b.report(s, "d", [Usage(x, 0.0, 0, 1) for x in buckets]))
        answered = {action.bucket for action in out.get(s.id, [])}
        assert answered == {key for key in keys if node[key] != dead}
        assert b.ledger is not None and b.ledger.failures == len(keys) - len(answered)
    finally:
        await store.close()


async def test_two_streams_holding_one_bucket_in_one_settle_never_take_the_same_units(case: Case) -> None:
    """One settle may carry two holds of one bucket (the reporting stream and another of
    this replica whose share its report changed). A store check evaluates every op on the
    state before its commits, so in one call both would take the same free units: the
    slices then summed past the limit (a three-replica timeline of the model: fill 3 and
    burst 53 held of 2 and 30, and 2.3 requests admitted past rate x t + burst)."""
    ledger = StoreLedger(case.store, Keys(), replica="a")
    key = tuple(sorted(BUCKETS[0].items()))
    answers = await ledger.hold_many([Hold(key, 1, LIMIT.total, LIMIT.total, 20.0),
                                      Hold(key, 2, LIMIT.total, LIMIT.total, 20.0),
                                      Hold(tuple(sorted(BUCKETS[1].items())), 1, LIMIT.total, LIMIT.total, 20.0)])
    granted = [answer.share for answer in answers if isinstance(answer, Granted)]
    assert len(granted) == 3
    assert granted[0] == LIMIT.total and granted[1] == NOTHING and granted[2] == LIMIT.total


async def test_a_store_grant_with_no_fill_is_sent_and_booked_as_nothing(case: Case) -> None:
    """Another holder has all the fill of the bucket but none of its burst: the store grants
    this stream burst and no fill, which Envoy gets as DENY_ALL (a token bucket needs both).
    The book counts what Envoy has: nothing, not a burst that no Envoy holds tokens of."""
    b = book(case, "a")
    key = tuple(sorted(BUCKETS[0].items()))
    ops = StoreLedger(case.store, Keys(), replica="x").ops(key, 1, Share(LIMIT.total.fill, 0), LIMIT.total, 60.0, 0)
    await case.store.check(ops, "")
    s = b.open("envoy")
    out = await b.settle(b.report(s, "d", [Usage(BUCKETS[0], 0.0, 0, 1)]))
    assert [action.share for action in out[s.id]] == [NOTHING]
    (shown,) = b.status()["streams"][0]["buckets"]  # type: ignore[index]
    assert (shown["fill"], shown["burst"]) == (0, 0)
    assert s.buckets[key].sent == NOTHING


def test_a_slice_s_tail_is_timed_on_the_fill_the_store_granted() -> None:
    """Another holder has 8 of the 10 fill and none of the burst: a stream asking the whole
    limit gets fill 2 and burst 20. Its slices outlive their TTL by the time its own fill
    refills its burst (``cool_tail``): 20 at 2 a second, 10 s, not the 2 s of the 10 fill it
    asked (no one else's fill refills that burst once its Envoy stops)."""
    clock = ManualClock()
    store = MemoryStore(clock)
    store.check_now(established(Keys()), "")
    b = QuotaBook(lambda: LIMITS, clock=clock, ledger=StoreLedger(store, Keys(), replica="a"))
    key = tuple(sorted(BUCKETS[0].items()))
    x = StoreLedger(store, Keys(), replica="x")
    store.check_now(x.ops(key, 1, Share(8, 0), LIMIT.total, 60.0, 0), "")
    s = b.open("envoy")

    async def run() -> dict[int, list[Action]]:
        return await b.settle(b.report(s, "d", [Usage(BUCKETS[0], 0.0, 0, 1)]))

    out = asyncio.run(run())
    assert [action.share for action in out[s.id]] == [Share(2, 20)]
    ttl = b.ttl + b.report_interval
    burst_key = x.ops(key, 1, NOTHING, LIMIT.total, 1.0, 0)[1].key
    assert store._slices[burst_key]["a.1"] == (20, clock.monotonic() + ttl + cool_tail(Share(2, 20), 1))
    assert cool_tail(Share(2, 20), 1) == 10.0


def test_a_release_cools_on_the_fill_the_store_holds_for_it() -> None:
    """Another holder has 8 of the 10 fill: a stream asking the whole limit holds fill 2
    and burst 20, and asks 10 fill again (its share's fill grows as its burst shrinks to 5:
    the store cuts the fill to 2 again). Once the shrink is confirmed, the 15 burst it
    releases cools on the fill the store holds for it, none spare (its Envoy uses the 2):
    until some is, not the 15 / 8 s that the 10 fill it asked would take."""
    clock = ManualClock()
    store = MemoryStore(clock)
    store.check_now(established(Keys()), "")
    b = QuotaBook(lambda: LIMITS, clock=clock, ledger=StoreLedger(store, Keys(), replica="a"))
    key = tuple(sorted(BUCKETS[0].items()))
    store.check_now(StoreLedger(store, Keys(), replica="x").ops(key, 1, Share(8, 0), LIMIT.total, 600.0, 0), "")
    s = b.open("envoy")

    async def settle(share: Share) -> Share | None:
        return (await b.settle({s.id: [Action(key, share, 1, b.ttl)]}))[s.id][0].share

    assert asyncio.run(b.settle(b.report(s, "d", [Usage(BUCKETS[0], 0.0, 0, 1)])))[s.id][0].share == Share(2, 20)
    held = s.buckets[key]
    clock.advance(5.0)
    assert asyncio.run(settle(Share(10, 5))) == Share(2, 5)  # asked 10 and 20 (the shrink waits)
    assert held.asked == Share(10, 20) and held.granted == Share(2, 20)
    held.ledger, held.until = held.share, 0.0  # the shrink confirmed (a report would)
    clock.advance(5.0)
    assert asyncio.run(settle(Share(2, 5))) == Share(2, 5)
    assert held.cool_until == float("inf")
