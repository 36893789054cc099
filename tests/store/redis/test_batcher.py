"""The auto-batcher (extauthz/store/redis/batcher.py): cancellation safety, releases riding
with the next check, one script call per batch.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from extauthz.core.clock import SYSTEM_CLOCK
from extauthz.core.context import RawRequest
from extauthz.core.errors import StoreUnavailable
from extauthz.engine.breaker import Breaker
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.policy import load_policy
from extauthz.store.base import BucketOp, CheckResult, LeaseOp
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import (
    RedisCluster,
    RedisSingle,
)
from tests.store.conftest import Topology, make_redis_store, masters
from tests.store.redis.helpers import BUCKET, FLEET, USER_LEASES, K, wait_until

CONC_POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: conc
    type: concurrent_requests
    limit: 5
    lease_ttl: 30s
"""


@pytest.mark.redis
@pytest.mark.parametrize("batching", [True, False], ids=["batching", "single-calls"])
async def test_abandoned_calls_neither_poison_connections_nor_keep_leases(
    redis_single_clean: RedisSingle, batching: bool, tmp_path: Path
) -> None:
    # A long socket timeout: the replies of the abandoned calls do arrive.
    store = make_redis_store(redis_single_clean, batching=batching, socket_timeout=10)
    # The engine gives back what an abandoned store answer committed (the one release path).
    (tmp_path / "conc.yaml").write_text(CONC_POLICY)
    engine = Engine(StoreGate(store, 0.02, breaker=Breaker(SYSTEM_CLOCK, threshold=1000)),
                    load_policy([tmp_path / "conc.yaml"]), keys=K)
    ctxs = [engine.context(RawRequest("GET", "/", headers={"x-api-key": f"user{i}"})) for i in range(20)]
    conc = engine.snapshot.limiters[0]
    users = [op.key for ctx in ctxs if (op := conc.op(ctx, True)) is not None]
    assert len(users) == 20
    try:
        await store.ping()
        await store.check([LeaseOp(users[0], 5, 30)], "warm")  # scripts loaded
        assert await store.release([users[0]], "warm") == 1
        redis_single_clean.pause()
        try:
            async def abandoned(i: int) -> None:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.02):
                        await store.check([BucketOp(K.bucket("r", f"user{i}"), 0.001, 5, 1)], f"b{i}")

            async def failed_open(i: int) -> None:
                decision = await engine.decide(ctxs[i])
                assert decision.allowed and decision.failures == ("timeout",)

            await asyncio.gather(*(abandoned(i) for i in range(20)), *(failed_open(i) for i in range(20)))
        finally:
            redis_single_clean.resume()

        # Every connection still pairs replies with the right commands.
        await asyncio.gather(*(store.set_value(f"t:v{i}", str(i)) for i in range(30)))
        values = await asyncio.gather(*(store.get_value(f"t:v{i}") for i in range(30)))
        assert values == [str(i) for i in range(30)]
        checks = await asyncio.gather(
            *(store.check([BucketOp(K.bucket("r", f"user{i}"), 0.001, 5, 1)], "n") for i in range(20)))
        # The abandoned checks took one token each (rate 0.001/s: no refill to speak of).
        assert [c.results[0].remaining for c in checks] == [pytest.approx(3.0, abs=0.01)] * 20

        # The engine failed those requests open and will never release their leases.
        async def released() -> bool:
            return await store.inflight(users) == [0] * 20

        await wait_until(released, 5, "the abandoned checks' leases to be released")

        async def counted() -> bool:  # counted when each release's reply is read, maybe later
            return engine.releaser.count("abandoned_answer", "released") >= 20

        await wait_until(counted, 5, "the abandoned checks' releases to be counted")
        assert engine.releaser.count("abandoned_answer", "released") == 20
    finally:
        redis_single_clean.resume()
        await engine.releaser.drain()
        await store.close()


@pytest.mark.redis
@pytest.mark.parametrize("topology_fixture", ["redis_single_clean", "redis_cluster_clean"])
async def test_releases_ride_with_the_next_check(
    request: pytest.FixtureRequest, topology_fixture: str
) -> None:
    """A release waits for the next check and goes out in its round trip (one pipeline
    write); alone, it is flushed by the ride timer. Counted by the store's round trips."""
    topology: Topology = request.getfixturevalue(topology_fixture)
    store = make_redis_store(topology)
    users = [K.user_leases("ride", f"user{i}") for i in range(3)]
    try:
        for i, key in enumerate(users):
            assert (await store.check([LeaseOp(key, 5, 30)], f"l{i}")).admitted
        trips = store.stats.round_trips
        release = asyncio.ensure_future(store.release([users[0]], "l0"))
        await asyncio.sleep(0)  # the release is queued, waiting for a check
        result = await store.check([LeaseOp(users[0], 5, 30)], "n0")
        assert await release == 1
        assert result.admitted and result.results[0].extra == 1.0  # released before the check ran
        assert store.stats.round_trips == trips + 1  # one round trip for both
        # No check comes: the timer sends the release on its own.
        assert await store.release([users[1]], "l1") == 1
        assert store.stats.round_trips == trips + 2
        assert await store.inflight(users) == [1, 0, 1]
    finally:
        await store.close()


@pytest.mark.redis
@pytest.mark.parametrize("topology_fixture", ["redis_single_clean", "redis_cluster_clean"])
async def test_releases_waiting_together_go_out_as_one_script_call(
    request: pytest.FixtureRequest, topology_fixture: str
) -> None:
    """The releases queued for one check are one script call (per slot group on a
    cluster), and each caller still gets its own count (0: not held)."""
    topology: Topology = request.getfixturevalue(topology_fixture)
    store = make_redis_store(topology)
    users = [K.user_leases("ride", f"user{i}") for i in range(3)]
    try:
        for i, key in enumerate(users):
            assert (await store.check([LeaseOp(key, 5, 30), LeaseOp(FLEET, 0, 30)], f"l{i}")).admitted
        calls = store.stats.commands
        releases = [asyncio.ensure_future(store.release([key, FLEET], f"l{i}"))
                    for i, key in enumerate(users)]
        gone = asyncio.ensure_future(store.release([users[0], FLEET], "never-held"))
        assert await asyncio.gather(*releases, gone) == [2, 2, 2, 0]
        if isinstance(topology, RedisCluster):
            # the fleet releases share the {fleet} slot: one call; each user is a slot of its own
            assert store.stats.commands == calls + 1 + 3
        else:
            assert store.stats.commands == calls + 1
        assert await store.inflight([*users, FLEET]) == [0, 0, 0, 0]
    finally:
        await store.close()


@pytest.mark.redis
@pytest.mark.parametrize("topology_fixture", ["redis_single_clean", "redis_cluster_clean"])
async def test_checks_of_one_batch_are_one_script_call_with_one_time(
    request: pytest.FixtureRequest, topology_fixture: str
) -> None:
    """Concurrent checks go out as one check.lua call (per hash tag on a cluster): one
    EVALSHA and one Redis TIME for all of them, each answered as if alone, in order."""
    topology: Topology = request.getfixturevalue(topology_fixture)
    store = make_redis_store(topology)
    bob, alice = K.bucket("merge", "bob"), K.bucket("merge", "alice")
    try:
        await store.ping()
        for c in masters(topology):
            with c:
                c.config_resetstat()
        calls = store.stats.commands
        checks = [store.check([BucketOp(bob, 0.001, 3, 1)], f"b{i}") for i in range(5)]
        checks.append(store.check([BucketOp(alice, 0.001, 3, 1), LeaseOp(USER_LEASES.replace("bob", "alice"), 5, 30)],
                                  "a0"))
        results = await asyncio.gather(*checks)
        assert [r.admitted for r in results] == [True, True, True, False, False, True]
        assert [r.results[0].remaining for r in results[:5]] == [2.0, 1.0, 0.0, 0.0, 0.0]
        assert results[5].results[1].extra == 1.0  # alice's lease, in the same call or not
        stats: dict[str, int] = {}
        for c in masters(topology):
            with c:
                for name, v in c.info("commandstats").items():
                    stats[name] = stats.get(name, 0) + int(v["calls"])
        # bob's five checks share one call; alice's is another slot on a cluster
        calls_sent = 2 if isinstance(topology, RedisCluster) else 1
        assert store.stats.commands == calls + calls_sent
        assert stats["cmdstat_evalsha"] == stats["cmdstat_time"] == calls_sent
        # bob's bucket is read once for his five checks (then kept in the script), written
        # at each of his 3 commits; alice's read and written once
        assert stats["cmdstat_get"] == 2 and stats["cmdstat_set"] == 4
    finally:
        await store.close()


@pytest.mark.redis
async def test_checks_with_different_injected_clocks_are_not_merged(redis_single_clean: RedisSingle) -> None:
    """"now" is shared by a merged call: checks reading different injected times go out as
    separate calls, each with its own time."""
    times = iter([100.0, 101.0])
    store = RedisStore.from_url(redis_single_clean.url, now=lambda: next(times))
    try:
        await store.ping()
        calls = store.stats.commands
        # submitted in one loop iteration (one batch), reading 100 and 101: one token a second
        first = store.check([BucketOp(BUCKET, 1, 1, 1)], "a")
        second = store.check([BucketOp(BUCKET, 1, 1, 1)], "b")
        assert [r.admitted for r in await asyncio.gather(first, second)] == [True, True]
        assert store.stats.commands == calls + 2
    finally:
        await store.close()


@pytest.mark.redis
async def test_a_release_rides_in_the_check_call_and_a_failing_entry_fails_alone(
    redis_single_clean: RedisSingle,
) -> None:
    """A waiting release is an entry of the next check's script call (one EVALSHA for
    both); a request whose key holds another type fails on its own (WRONGTYPE, raised for
    that caller) while the others of the same call are answered."""
    store = make_redis_store(redis_single_clean)
    broken = K.bucket("rate", "mallory")
    try:
        assert (await store.check([LeaseOp(USER_LEASES, 5, 30)], "held")).admitted
        with redis_single_clean.client() as c:
            c.hset(broken, "t", "1")  # a hash where a bucket string belongs
            c.config_resetstat()
        calls = store.stats.commands
        release = asyncio.ensure_future(store.release([USER_LEASES], "held"))
        await asyncio.sleep(0)  # queued, waiting for a check
        good = store.check([BucketOp(BUCKET, 1, 10, 1), LeaseOp(USER_LEASES, 5, 30)], "next")
        bad = store.check([BucketOp(broken, 1, 10, 1)], "x")
        lease = store.check([LeaseOp(FLEET, 0, 30)], "y")
        outcomes = await asyncio.gather(release, good, bad, lease, return_exceptions=True)
        assert outcomes[0] == 1
        assert isinstance(outcomes[1], CheckResult) and outcomes[1].admitted
        assert outcomes[1].results[1].extra == 1.0  # the release ran first: only "next" holds
        assert isinstance(outcomes[2], StoreUnavailable) and "WRONGTYPE" in str(outcomes[2])
        assert isinstance(outcomes[3], CheckResult) and outcomes[3].admitted
        assert store.stats.commands == calls + 1  # one script call for all four
        with redis_single_clean.client() as c:
            assert c.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
            assert c.hgetall(broken) == {"t": "1"}  # nothing written for the failed request
    finally:
        await store.close()

