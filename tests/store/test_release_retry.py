"""On a real Redis: a lease release that fails (Redis down, or refusing writes) is tried again
until it succeeds, and the slot is free long before its TTL. Before the fix the failure was
counted once and the slot stayed held for the whole ``lease_ttl``."""

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
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import RedisSingle, start_single
from tests.store.redis.helpers import wait_until
from tests.store.test_redis_stalls import Load, no_lease_left

pytestmark = pytest.mark.redis

POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-concurrency
    type: concurrent_requests
    limit: 1
    lease_ttl: 120s
"""


async def test_a_release_that_fails_while_redis_is_down_frees_the_slot_when_it_is_back(tmp_path: Path) -> None:
    redis = start_single(tmp_path)
    try:
        if redis.backend != "process":
            pytest.skip("needs a local redis-server that reloads its dump.rdb on restart")
        (tmp_path / "p.yaml").write_text(POLICY)
        store = RedisStore.from_url(redis.url, deadline=0.5, socket_timeout=1.0, socket_connect_timeout=1.0)
        engine = Engine(StoreGate(store, 0.5), load_policy([tmp_path / "p.yaml"]))
        raw = RawRequest("GET", "/v1/x", headers={"x-api-key": "sk_live_retry"})
        try:
            _, held = await engine.check(raw)
            assert held.allowed and held.leases and not held.failures
            _, refused = await engine.check(raw)
            assert not refused.allowed  # the one slot is held
            keys = list(held.leases)

            # Redis goes away with the lease on disk (as a failover keeps it on the new master)
            redis.client().save()
            redis.kill()
            releaser = engine.releaser
            # The failure under test is Redis being down, not the release deadline: on a loaded
            # machine a 50 ms deadline can time out a release that ran (then the next try finds
            # nothing to free and counts "none"), so give each try room.
            releaser.timeout = 2.0
            task = releaser.release(keys, held.lease_id, "access_log")
            assert task is not None

            async def tried() -> bool:
                return releaser.count("access_log") > 0

            await wait_until(tried, 20, "a first failed try")
            assert releaser.count("access_log", "released") == 0
            await asyncio.to_thread(redis.restart)  # back, the lease still held (loaded from dump.rdb)

            async def free() -> bool:
                try:
                    return (await store.inflight(keys)) == [0]
                except StoreUnavailable:  # the store is still reconnecting
                    return False

            await wait_until(free, 20, "the slot given back by a retry")
            # the release's reply and the check's can land in one read: the task counts next
            assert await asyncio.wait_for(task, 5) == 1
            assert releaser.count("access_log", "released") == 1
            assert releaser.count("access_log", "error") == 0
            assert releaser.count("access_log", "retried") >= 1
            _, again = await engine.check(raw)
            assert again.allowed and not again.failures
        finally:
            await engine.releaser.drain(within=1.0)
            await store.close()
    finally:
        redis.stop()


async def test_releases_failing_under_load_are_retried_and_no_lease_is_left_held(
        tmp_path: Path, redis_single_clean: RedisSingle) -> None:
    """Checks from concurrent callers while the master refuses writes for a moment (as a
    master does while it loses its replicas, or during a failover): the access-log releases
    of the requests admitted just before fail, are tried again, and once Redis takes writes
    again every slot is free, long before the 120 s lease TTL."""
    (tmp_path / "p.yaml").write_text(POLICY.replace("limit: 1", "limit: 1000"))
    store = RedisStore.from_url(redis_single_clean.url, deadline=0.05, socket_timeout=1.0,
                                socket_connect_timeout=1.0)
    engine = Engine(StoreGate(store, 0.05, breaker=Breaker(SYSTEM_CLOCK, threshold=10**9)),
                    load_policy([tmp_path / "p.yaml"]))
    load = Load(engine, [f"user{i}" for i in range(40)])
    admin = redis_single_clean.client(socket_timeout=2)
    try:
        await load.run(0.3)
        assert engine.releaser.count("access_log", "released") > 0
        admin.config_set("min-replicas-to-write", 1)  # every write now answers NOREPLICAS
        try:
            await load.run(1.0)
        finally:
            admin.config_set("min-replicas-to-write", 0)
        await load.run(0.5)
        await no_lease_left(redis_single_clean, "the writes came back")
        assert engine.releaser.count("access_log", "retried") > 0  # some failed and were retried
        assert engine.releaser.count("access_log", "error") == 0
    finally:
        admin.config_set("min-replicas-to-write", 0)
        admin.close()
        await engine.releaser.drain(within=1.0)
        await store.close()
