"""Issue 20 defect 9 on a real Redis: a lease release that fails (Redis down) is tried again
until it succeeds, and the slot is free long before its TTL. Before the fix the failure was
counted once and the slot stayed held for the whole ``lease_ttl``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from extauthz.context import RawRequest
from extauthz.engine import Engine
from extauthz.errors import StoreUnavailable
from extauthz.policy import load_policy
from extauthz.store.redis import RedisStore
from tests.infra.redis_servers import start_single
from tests.store.test_redis_specific import wait_until

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
        engine = Engine(store, load_policy([tmp_path / "p.yaml"]), deadline=0.5)
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
            assert releaser.count("access_log", "released") == 1
            assert releaser.count("access_log", "error") == 0
            assert releaser.count("access_log", "retried") >= 1
            await asyncio.wait_for(task, 5)
            _, again = await engine.check(raw)
            assert again.allowed and not again.failures
        finally:
            await engine.releaser.drain(within=1.0)
            await store.close()
    finally:
        redis.stop()
