"""The ``store`` fixture: the same tests against every store.

Parametrized over the embedded memory store and the Redis store on a real single Redis,
a real 3-master Redis Cluster and a real Sentinel pair (``tests.infra`` fixtures; flushed
before each test). Every store reads one :class:`~extauthz.core.clock.ManualClock`: the
memory store as its clock, the Redis store as the injected ``now`` passed to the
scripts, so timelines are exact and need no sleeping.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from extauthz.core.clock import ManualClock
from extauthz.store.base import Store
from extauthz.store.memory import MemoryStore
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import RedisCluster, RedisSentinel, RedisSingle

Topology = RedisSingle | RedisCluster | RedisSentinel

#: store kind -> the function-scoped (flushed) topology fixture
TOPOLOGY_FIXTURES = {
    "redis": "redis_single_clean",
    "redis-cluster": "redis_cluster_clean",
    "redis-sentinel": "redis_sentinel_clean",
}

STORE_KINDS = [
    "memory",
    *(pytest.param(kind, marks=pytest.mark.redis) for kind in TOPOLOGY_FIXTURES),
]


def masters(topology: Topology) -> list[redis.Redis]:
    """Sync clients to every master of a topology (the cluster: one per node)."""
    if isinstance(topology, RedisCluster):
        return [topology.node_client(i) for i in range(len(topology.nodes))]
    return [topology.client()]


def key_ttls(topology: Topology) -> dict[str, int]:
    """Every key on every master with its PTTL in ms (-1: none, -2: gone)."""
    out: dict[str, int] = {}
    for client in masters(topology):
        with client:
            for key in client.scan_iter(count=1000):
                out[key] = int(client.pttl(key))
    return out


def key_expiry_times(topology: Topology) -> dict[str, int]:
    """Every key on every master with its absolute expiry (PEXPIRETIME, Unix ms).

    Unlike a PTTL it does not shrink while the test runs, so a loaded machine cannot move it.
    """
    out: dict[str, int] = {}
    for client in masters(topology):
        with client:
            for key in client.scan_iter(count=1000):
                out[key] = int(client.pexpiretime(key))
    return out


def redis_time_ms(topology: Topology) -> int:
    """Redis's own clock (TIME) in Unix ms, floored: the clock key expiries are set from."""
    client = masters(topology)[0]
    with client:
        seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@dataclass
class StoreCase:
    kind: str
    store: Store
    clock: ManualClock
    topology: Topology | None

    @property
    def is_redis(self) -> bool:
        return self.topology is not None

    def value_ttl(self, key: str) -> float | None:
        """Seconds left before a plain value expires (None: no expiry or no value)."""
        if self.topology is None:
            assert isinstance(self.store, MemoryStore)
            item = self.store._values.get(key)
            if item is None or item[1] is None:
                return None
            return item[1] - self.clock.now
        ttls = key_ttls(self.topology)
        return ttls[key] / 1000.0 if ttls.get(key, -1) >= 0 else None

    def wall(self) -> float:
        """The clock event logs are stamped with: the injected one for the memory store;
        Redis's own (stream ids are server milliseconds) for Redis."""
        return self.clock.wall() if self.topology is None else time.time()

    def let_values_expire(self, seconds: float) -> None:
        """Move time past a plain value's TTL. Redis expires keys on its own clock, which
        cannot be injected: for Redis this waits (the TTLs used with it are tens of ms)."""
        self.clock.advance(seconds)
        if self.topology is not None:
            time.sleep(seconds + 0.01)


#: socket timeouts of the stores these tests call directly (no engine deadline around them).
#: The production default derives from the engine's deadline (0.25 s for 5 ms): a correct
#: call that merely waits its turn on a loaded 2-core machine (40 connections opened at
#: once while SCRIPT FLUSH runs) would fail with "Timeout connecting". These tests are about
#: what the store answers; the failure tests set their own timeouts.
DIRECT_CALL_TIMEOUT = 5.0


def make_redis_store(topology: Topology, clock: ManualClock | None = None, **kw: Any) -> RedisStore:
    kw.setdefault("socket_timeout", DIRECT_CALL_TIMEOUT)
    kw.setdefault("socket_connect_timeout", DIRECT_CALL_TIMEOUT)
    return RedisStore.from_url(topology.url, now=None if clock is None else clock.monotonic, **kw)


@pytest.fixture(params=STORE_KINDS)
async def store_case(request: pytest.FixtureRequest) -> AsyncIterator[StoreCase]:
    clock = ManualClock()
    kind: str = request.param
    if kind == "memory":
        yield StoreCase(kind, MemoryStore(clock), clock, None)
        return
    topology: Topology = request.getfixturevalue(TOPOLOGY_FIXTURES[kind])
    store = make_redis_store(topology, clock)
    try:
        yield StoreCase(kind, store, clock, topology)
    finally:
        await store.close()


@pytest.fixture
def store(store_case: StoreCase) -> Store:
    return store_case.store
