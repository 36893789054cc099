"""What only the Redis store (extauthz/store/redis/store.py) has to prove: atomicity across
clients, failures (fail-open through the engine), Sentinel failover, refused floods kept off Redis.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extauthz.core.clock import SYSTEM_CLOCK
from extauthz.core.context import RawRequest
from extauthz.engine.breaker import Breaker
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.policy import Policy, load_policy
from extauthz.store.base import BucketOp, CheckResult, LeaseOp, Op
from extauthz.store.keys import Keys
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import (
    RedisCluster,
    RedisSentinel,
    RedisSingle,
    start_sentinel,
)
from tests.store.conftest import Topology, make_redis_store
from tests.store.redis.helpers import BUCKET, FLEET, wait_until

POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-rate
    type: request_rate
    rate: 1000
    burst: 100000
  - name: fleet
    type: fleet_usage
    capacity: 1000000
    reserved_for_critical: 0.2
    lease_ttl: 5s
"""


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return load_policy([path])


@pytest.mark.redis
@pytest.mark.parametrize("topology_fixture", ["redis_single_clean", "redis_cluster_clean"])
async def test_200_concurrent_checks_against_a_bucket_of_50_admit_50(
    request: pytest.FixtureRequest, topology_fixture: str
) -> None:
    """8 tasks over two clients (one batching, one not), Redis TIME as the clock. Each
    request also takes a fleet lease (another slot on a cluster): the refused ones must
    give it back."""
    topology: Topology = request.getfixturevalue(topology_fixture)
    stores = [make_redis_store(topology, batching=True), make_redis_store(topology, batching=False)]
    ops: list[Op] = [BucketOp(BUCKET, 0.001, 50, 1), LeaseOp(FLEET, 0, 30)]
    results: list[CheckResult] = []

    async def worker(store: RedisStore, w: int) -> None:
        for i in range(25):
            results.append(await store.check(ops, f"w{w}-{i}"))

    try:
        await asyncio.gather(*(worker(stores[w % 2], w) for w in range(8)))
        assert len(results) == 200
        assert sum(r.admitted for r in results) == 50
        assert await stores[0].inflight([FLEET]) == [50]
        if isinstance(topology, RedisCluster):
            assert sum(s.stats.compensations for s in stores) == 150
    finally:
        for store in stores:
            await store.close()


#: Client socket timeouts in the failure tests: a check that waited for the client (rather
#: than being cut by the engine's deadline) would take at least this long.
CLIENT_TIMEOUT = 2.0


#: Deadline + margin every check must meet: a correctness bound, not a speed target. Far
#: below CLIENT_TIMEOUT, generous for a noisy 2-core machine (event-loop stalls of 100+ ms
#: were seen there while other test suites ran).
MARGIN = 0.3


#: ... and the small margin that 99% of the checks must meet (measured here: p99 1-3 ms).
P99_MARGIN = 0.025


def _latencies_ok(latencies: list[float], bound: float) -> str:
    ordered = sorted(latencies)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    summary = (f"{len(ordered)} checks: p50 {statistics.median(ordered) * 1000:.2f} ms, "
               f"p99 {p99 * 1000:.2f} ms, max {ordered[-1] * 1000:.2f} ms")
    assert ordered[-1] <= bound, summary
    assert p99 <= bound - MARGIN + P99_MARGIN, summary
    return summary


@pytest.mark.redis
async def test_fail_open_fast_when_redis_stops_or_pauses_then_recovers(
    redis_single_clean: RedisSingle, policy: Policy
) -> None:
    deadline = 0.005
    bound = deadline + MARGIN
    store = RedisStore.from_url(redis_single_clean.url, deadline=deadline,
                                socket_timeout=CLIENT_TIMEOUT, socket_connect_timeout=CLIENT_TIMEOUT)
    breaker = Breaker(SYSTEM_CLOCK, threshold=5, open_for=0.2)
    engine = Engine(StoreGate(store, deadline, breaker=breaker), policy)
    latencies: list[float] = []
    counter = 0

    async def run_checks(seconds: float, tasks: int = 3) -> list[tuple[bool, tuple[str, ...]]]:
        out: list[tuple[bool, tuple[str, ...]]] = []
        stop = time.monotonic() + seconds

        async def one_task() -> None:
            nonlocal counter
            while time.monotonic() < stop:
                counter += 1
                raw = RawRequest("GET", "/v1/things", headers={"x-api-key": f"user{counter % 50}"})
                started = time.perf_counter()
                _, decision = await engine.check(raw)
                latencies.append(time.perf_counter() - started)
                out.append((decision.allowed, decision.failures))
                await asyncio.sleep(0.002)

        await asyncio.gather(*(one_task() for _ in range(tasks)))
        return out

    async def recovered() -> bool:
        _, decision = await engine.check(RawRequest("GET", "/", headers={"x-api-key": "probe"}))
        return decision.allowed and not decision.failures

    try:
        await store.ping()
        await wait_until(recovered, 5, "a first store-backed check")
        healthy = await run_checks(0.3)
        assert sum(not f for _, f in healthy) >= 0.8 * len(healthy)  # store-backed answers

        phases = []
        for name, stop, start in [("stopped", redis_single_clean.kill, redis_single_clean.restart),
                                  ("paused", redis_single_clean.pause, redis_single_clean.resume)]:
            before = dict(engine.failures)
            latencies.clear()
            stop()
            try:
                down = await run_checks(0.8)
            finally:
                start()
            assert all(allowed for allowed, _ in down)  # every check answered: failed open
            assert sum(bool(f) for _, f in down) >= 0.9 * len(down)
            phases.append(f"{name}: {_latencies_ok(latencies, bound)}")
            new = {k: v - before.get(k, 0) for k, v in engine.failures.items()}
            reason = "unavailable" if name == "stopped" else "timeout"
            assert new.get(reason, 0) >= engine.gate.breaker.threshold, new
            assert new.get("circuit_open", 0) > 0, new  # the breaker opened
            await wait_until(recovered, 5, f"recovery after Redis was {name}")
            assert engine.gate.breaker.state == "closed"
        print("; ".join(phases))
    finally:
        redis_single_clean.resume()
        await store.close()


@pytest.fixture
def own_sentinel(tmp_path: Path) -> Iterator[RedisSentinel]:
    """A Sentinel pair of this test's own: a failover leaves the session topology alone."""
    topology = start_sentinel(tmp_path)
    try:
        yield topology
    finally:
        topology.stop()


@pytest.mark.redis
async def test_sentinel_failover_while_checks_continue(own_sentinel: RedisSentinel,
                                                       policy: Policy) -> None:
    topology = own_sentinel
    deadline = 0.005
    store = RedisStore.from_url(topology.url, deadline=deadline,
                                socket_timeout=CLIENT_TIMEOUT, socket_connect_timeout=CLIENT_TIMEOUT)
    breaker = Breaker(SYSTEM_CLOCK, threshold=5, open_for=0.2)
    engine = Engine(StoreGate(store, deadline, breaker=breaker), policy)
    answered: list[tuple[float, bool, tuple[str, ...]]] = []
    latencies: list[float] = []
    done = asyncio.Event()

    async def checker(n: int) -> None:
        i = 0
        while not done.is_set():
            i += 1
            started = time.perf_counter()
            _, d = await engine.check(RawRequest("GET", "/", headers={"x-api-key": f"u{n}-{i}"}))
            latencies.append(time.perf_counter() - started)
            answered.append((time.monotonic(), d.allowed, d.failures))
            await asyncio.sleep(0.005)

    try:
        old_master = topology.master_port
        checkers = [asyncio.create_task(checker(n)) for n in range(2)]

        async def store_backed_before() -> bool:  # not a fixed 0.2 s: the first connections
            return any(not f for _, _, f in answered)  # may miss the 5 ms deadline under load

        await wait_until(store_backed_before, 10, "a store-backed check before the failover")
        # Kill the master; the sentinel promotes the replica (no rejoin: one stable master).
        failover_s = await asyncio.to_thread(topology.failover, rejoin=False)
        promoted_at = time.monotonic()
        assert topology.master_port != old_master

        async def store_backed_after_failover() -> bool:
            return any(t > promoted_at and not f for t, _, f in answered)

        await wait_until(store_backed_after_failover, 10, "a store-backed check on the new master")
        done.set()
        await asyncio.gather(*checkers)
        assert all(allowed for _, allowed, _ in answered)  # every check answered
        summary = _latencies_ok(latencies, deadline + MARGIN)
        failed = sum(bool(f) for _, _, f in answered)
        print(f"failover {failover_s:.2f}s; {failed}/{len(answered)} checks failed open; {summary}")
        with topology.client() as new_master:  # the store writes to the promoted master
            assert new_master.exists(Keys().fleet_leases("fleet", "other"))
    finally:
        done.set()
        await store.close()


@pytest.mark.redis
async def test_a_refused_flood_sends_no_evalsha_while_its_refusal_runs(
    redis_single_clean: RedisSingle, tmp_path: Path
) -> None:
    """Counted by Redis itself (INFO commandstats): after the first refusal a flooding key
    is answered locally, with the store's own numbers, until its bucket admits again."""
    (tmp_path / "p.yaml").write_text(
        "version: 1\nidentity:\n  - header: x-api-key\nlimiters:\n"
        "  - name: user-rate\n    type: request_rate\n    rate: 0.1\n    burst: 2\n")
    store = make_redis_store(redis_single_clean)
    engine = Engine(StoreGate(store, 5.0), load_policy([tmp_path / "p.yaml"]))

    def evalsha_calls() -> int:
        with redis_single_clean.client() as c:
            return int(c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    try:
        flood = RawRequest("GET", "/", headers={"x-api-key": "flood"})
        assert [(await engine.check(flood))[1].allowed for _ in range(3)] == [True, True, False]
        before = evalsha_calls()
        answers = [(await engine.check(flood))[1] for _ in range(50)]
        assert evalsha_calls() == before  # 50 refusals, no script call
        assert all(not d.allowed and d.denied_by is not None for d in answers)
        retry = [d.denied_by.retry_after for d in answers if d.denied_by is not None]
        assert all(r is not None and 0 < r <= 10.0 for r in retry)
        assert retry == sorted(retry, reverse=True)  # counting down, as the bucket refills
        # Another key still goes to the store.
        _, other = await engine.check(RawRequest("GET", "/", headers={"x-api-key": "calm"}))
        assert other.allowed and evalsha_calls() == before + 1
    finally:
        await store.close()

