"""Redis stalls under load (issue 20, defects 3 and 4), on real Redis only.

* A stall longer than the client's socket timeout: the checks written before it still run
  when Redis resumes. Their outcome is unknown to the server when it gives up, so it keeps
  reading their replies and gives back what they committed (no lease left held); a
  connection lost with checks written on it has their lease ids released once Redis
  answers again.
* Redis Cluster, one master paused: the users whose keys live on the healthy masters keep
  being decided (a breaker per master, each master's replies delivered as they come).

Every test runs checks from concurrent callers through the engine, releases what each
admitted request holds (as the access log would), and after every request finished counts
the lease members left in Redis.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from extauthz.core.clock import SYSTEM_CLOCK
from extauthz.core.context import RawRequest
from extauthz.engine.breaker import Breaker
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.policy import Policy, load_policy
from extauthz.store.redis import RedisStore
from extauthz.store.redis.cluster import node_of as cluster_node_of
from testinfra.redis_servers import RedisCluster, RedisSingle
from tests.store.conftest import Topology, masters
from tests.store.redis.helpers import wait_until

POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-concurrency
    type: concurrent_requests
    limit: 1000
    lease_ttl: 60s
  - name: fleet
    type: fleet_usage
    capacity: 100000
    reserved_for_critical: 0
    lease_ttl: 60s
"""

#: The client's socket timeout here: short, so that a stall of STALL seconds passes it (the
#: production default is 50 x the deadline, at least 0.25 s).
SOCKET_TIMEOUT = 0.25
STALL = 1.0
#: The engine's deadline: far above a noisy machine's stalls (the stall must be what fails).
DEADLINE = 0.05
#: The cluster test's deadline and pause (shorter than the fixture's cluster-node-timeout,
#: 2 s: no master is marked failed, the healthy ones keep serving their slots).
CLUSTER_DEADLINE = 0.2
CLUSTER_STALL = 1.5


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return load_policy([path])


def leases_held(topology: Topology) -> int:
    """Lease members (concurrency and fleet sorted sets) on every master, expired or not."""
    held = 0
    for client in masters(topology):
        with client:
            for key in client.scan_iter(match="*", count=1000):
                if client.type(key) == "zset":
                    held += int(client.zcard(key))
    return held


async def no_lease_left(topology: Topology, after: str) -> None:
    """Wait (a few seconds at most) until no lease is held on any master."""
    async def none_held() -> bool:
        return leases_held(topology) == 0

    await wait_until(none_held, 10, f"no lease left held after {after}")


async def abandoned_answers_released(engine: Engine, after: str) -> None:
    """Wait (a few seconds at most) until the abandoned-answer path has counted a release.
    Read after :func:`no_lease_left`, not at once: that saw Redis apply the release, and a
    release is counted when its reply is read, a loop turn or more later (the count read
    in between was 0 once on a loaded machine)."""
    async def counted() -> bool:
        return engine.releaser.count("abandoned_answer") >= 1

    await wait_until(counted, 5, f"the abandoned answers' release after {after}")


def single(redis: RedisSingle, policy: Policy, timeout: float, **kw: Any) -> tuple[RedisStore, Engine]:
    """A store on ``redis`` with ``timeout`` s sockets and an engine at DEADLINE whose breaker
    never opens: every check reaches the store (an open breaker on a loaded machine would
    keep the checks off the stalled connection, and the test from its point)."""
    store = RedisStore.from_url(redis.url, deadline=DEADLINE, socket_timeout=timeout,
                                socket_connect_timeout=timeout, **kw)
    return store, Engine(StoreGate(store, DEADLINE, breaker=Breaker(SYSTEM_CLOCK, threshold=10**9)), policy)


class Load:
    """Concurrent callers through the engine; each admitted request holds its leases for a
    moment, then they go back through the engine's release path (as the access log's would)."""

    def __init__(self, engine: Engine, users: list[str], callers: int = 16) -> None:
        self.engine = engine
        self.users = users
        self.callers = callers
        self.decided: dict[str, list[tuple[bool, tuple[str, ...]]]] = {u: [] for u in users}
        self.running = True

    async def caller(self, n: int) -> None:
        i = n
        while self.running:
            user = self.users[i % len(self.users)]
            i += self.callers
            _, decision = await self.engine.check(
                RawRequest("GET", "/v1/things", headers={"x-api-key": user}))
            self.decided[user].append((decision.allowed, decision.failures))
            await asyncio.sleep(0.001)
            if decision.leases:
                self.engine.releaser.release(decision.leases, decision.lease_id, "access_log")

    async def run(self, seconds: float) -> None:
        self.running = True  # a second run() runs too (the last one's finally stopped it)
        callers = [asyncio.ensure_future(self.caller(n)) for n in range(self.callers)]
        try:
            await asyncio.sleep(seconds)
        finally:
            self.running = False
            await asyncio.gather(*callers)

    def reset(self) -> None:
        self.decided = {u: [] for u in self.users}


@pytest.mark.redis
@pytest.mark.parametrize("batching", [True, False], ids=["batching", "single-calls"])
async def test_a_stall_past_the_socket_timeout_leaves_no_lease_held(
    redis_single_clean: RedisSingle, policy: Policy, batching: bool
) -> None:
    store, engine = single(redis_single_clean, policy, SOCKET_TIMEOUT, batching=batching)
    load = Load(engine, [f"user{i}" for i in range(40)])
    try:
        await store.ping()

        async def stall() -> None:
            await asyncio.sleep(0.3)
            redis_single_clean.pause()
            try:
                await asyncio.sleep(STALL)  # > SOCKET_TIMEOUT: the client gives up on Redis
            finally:
                redis_single_clean.resume()

        stalled = asyncio.ensure_future(stall())
        await load.run(0.3 + STALL + 0.5)
        await stalled
        decided = [d for ds in load.decided.values() for d in ds]
        # The stall was felt: checks timed out past the socket timeout or failed open.
        assert any(failures for _, failures in decided), "the stall was not felt"
        assert any(not failures for _, failures in decided)

        # Every request finished and its release was sent; what the stalled checks
        # committed once Redis resumed must be given back too (not held for lease_ttl).
        await no_lease_left(redis_single_clean, "the stall")
        # ... by the abandoned-answer path (a release that outlived the Releaser's own
        # timeout in the burst after the resume still ran: counted ``error``)
        await abandoned_answers_released(engine, "the stall")
    finally:
        redis_single_clean.resume()
        await engine.releaser.drain()
        await store.close()


@pytest.mark.redis
async def test_a_connection_lost_after_the_write_leaves_no_lease_held(
    redis_single_clean: RedisSingle, policy: Policy
) -> None:
    # Long socket timeouts: here the connection is lost (reset on the client's side while
    # Redis is paused, as a middlebox would) before any timeout, with checks written on it.
    store, engine = single(redis_single_clean, policy, 5.0)
    load = Load(engine, [f"user{i}" for i in range(40)])
    try:
        await store.ping()

        async def reset_while_paused() -> None:
            await asyncio.sleep(0.3)
            redis_single_clean.pause()
            try:
                await asyncio.sleep(0.2)  # checks are written and wait for their replies
                node = store._nodes[""]
                assert node._protocol is not None
                node._protocol.abort(ConnectionResetError("connection reset"))
                await asyncio.sleep(0.3)
            finally:
                redis_single_clean.resume()

        reset = asyncio.ensure_future(reset_while_paused())
        await load.run(1.3)
        await reset
        decided = [d for ds in load.decided.values() for d in ds]
        assert any(failures for _, failures in decided), "the reset was not felt"

        # The checks written before the reset ran when Redis resumed: nobody heard their
        # answers, so their leases are released once Redis answers again.
        await no_lease_left(redis_single_clean, "the reset")
        await abandoned_answers_released(engine, "the reset")
    finally:
        redis_single_clean.resume()
        await engine.releaser.drain()
        await store.close()


def master_of(store: RedisStore, key: str) -> str:
    node = cluster_node_of(store.client, key)
    assert node is not None
    return str(node.name)


def user_key(engine: Engine, user: str) -> str:
    """The key of ``user``'s concurrency lease (its hash tag decides its master)."""
    ctx = engine.context(RawRequest("GET", "/v1/things", headers={"x-api-key": user}))
    lim = engine.snapshot.limiters[0]
    op = lim.op(ctx, True)
    assert op is not None and lim.name == "user-concurrency"
    return op.key


@pytest.mark.redis
async def test_one_paused_cluster_master_fails_open_only_its_own_users(
    redis_cluster_clean: RedisCluster, policy: Policy
) -> None:
    cluster = redis_cluster_clean
    # A deadline far above this shared machine's event-loop stalls (tens of ms under load):
    # what fails must be the paused master, not the machine.
    store = RedisStore.from_url(cluster.url, deadline=CLUSTER_DEADLINE, socket_timeout=1.0,
                                socket_connect_timeout=1.0)
    engine = Engine(StoreGate(store, CLUSTER_DEADLINE), policy)
    try:
        await store.ping()
        fleet_op = engine.snapshot.limiters[1].op(
            engine.context(RawRequest("GET", "/", headers={"x-api-key": "x"})), True)
        assert fleet_op is not None
        fleet_master = master_of(store, fleet_op.key)
        names = [f"{cluster.host}:{port}" for port in cluster.ports]
        paused = next(i for i, name in enumerate(names) if name != fleet_master)
        users = [f"user{i}" for i in range(60)]
        on_paused = {u for u in users if master_of(store, user_key(engine, u)) == names[paused]}
        healthy = [u for u in users if u not in on_paused]
        assert on_paused and healthy
        load = Load(engine, users)
        await load.run(0.3)  # warm: connections and scripts on every master

        load.reset()
        load.running = True
        cluster.pause(paused)  # shorter than cluster-node-timeout (2 s): nobody fails over
        try:
            await load.run(CLUSTER_STALL)
        finally:
            cluster.resume(paused)
        healthy_checks = [d for u in healthy for d in load.decided[u]]
        paused_checks = [d for u in on_paused for d in load.decided[u]]
        failed_healthy = sum(1 for _, failures in healthy_checks if failures)
        print(f"paused master's users: {len(paused_checks)} checks; others: {len(healthy_checks)} "
              f"checks, {failed_healthy} failed open")
        # The paused master's users fail open (the store cannot decide them) ...
        assert paused_checks and all(failures for _, failures in paused_checks)
        # ... and the others keep being decided by the store: only the checks caught in the
        # first moments (before the paused master's breaker opened) may fail.
        assert len(healthy_checks) >= 100, len(healthy_checks)
        assert failed_healthy <= len(healthy_checks) // 10, (failed_healthy, len(healthy_checks),
                                                             engine.failures)
        assert engine.gate.node_breakers[names[paused]].state != "closed"
        assert engine.gate.node_breakers[fleet_master].state == "closed"

        await no_lease_left(cluster, "the pause")
    finally:
        cluster.resume()
        await engine.releaser.drain()
        await store.close()
