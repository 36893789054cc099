"""Redis stalls under load (issue 20, defects 3 and 4), on real Redis only.

* A stall longer than the client's socket timeout: the checks written before it still run
  when Redis resumes. Their outcome is unknown to the server when it gives up, so it keeps
  reading their replies and gives back what they committed (no lease left held).
* Redis Cluster, one master paused: the users whose keys live on the healthy masters keep
  being decided (a breaker per master, each master's replies delivered as they come).

Every test runs checks from concurrent callers through the engine, releases what each
admitted request holds (as the access log would), and after every request finished counts
the lease members left in Redis.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from extauthz.context import RawRequest
from extauthz.engine import Engine
from extauthz.policy import Policy, load_policy
from extauthz.store.redis import RedisStore
from tests.infra.redis_servers import RedisSingle
from tests.store.conftest import Topology, masters
from tests.store.test_redis_specific import wait_until

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
    store = RedisStore.from_url(redis_single_clean.url, deadline=DEADLINE, batching=batching,
                                socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT)
    engine = Engine(store, policy, deadline=DEADLINE)
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

        async def none_held() -> bool:
            return leases_held(redis_single_clean) == 0

        # Every request finished and its release was sent; what the stalled checks
        # committed once Redis resumed must be given back too (not held for lease_ttl).
        await wait_until(none_held, 10, "no lease left held after the stall")
        assert engine.releaser.count("abandoned_answer", "released") >= 1
    finally:
        redis_single_clean.resume()
        await engine.releaser.drain()
        await store.close()
