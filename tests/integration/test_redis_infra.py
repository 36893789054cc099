"""The real-Redis fixtures behave as the store tests will need them to."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.crc import key_slot
from redis.exceptions import ClusterCrossSlotError
from redis.retry import Retry

from testinfra.redis_servers import (
    SENTINEL_SERVICE,
    RedisCluster,
    RedisSentinel,
    RedisSingle,
    start_single,
)

pytestmark = pytest.mark.redis

# Touches both keys, so Redis Cluster requires them to share a slot.
SET_BOTH = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2])}
"""


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


def _no_retry_async() -> AsyncRetry:
    return AsyncRetry(NoBackoff(), 0)


# --------------------------------------------------------------------------- single


def test_single_set_get(redis_single_clean: RedisSingle) -> None:
    assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", redis_single_clean.url)
    assert redis_single_clean.ports == (redis_single_clean.port,)
    print(f"single ({redis_single_clean.backend}) started in {redis_single_clean.startup_seconds:.3f}s")
    with redis.Redis.from_url(redis_single_clean.url, decode_responses=True) as client:
        assert client.set("k", "v")
        assert client.get("k") == "v"
        redis_single_clean.flushall()
        assert client.dbsize() == 0


def test_single_with_password(tmp_path: Path) -> None:
    handle = start_single(tmp_path, password="s3cret")
    try:
        assert re.fullmatch(r"redis://:s3cret@127\.0\.0\.1:\d+/0", handle.url)
        with redis.Redis.from_url(handle.url) as client:
            assert client.ping()
        # No retry: redis-py 8 retries AuthenticationError (a ConnectionError) 10 times.
        with (
            redis.Redis(host=handle.host, port=handle.port, retry=_no_retry()) as anonymous,
            pytest.raises(redis.AuthenticationError),
        ):
            anonymous.get("k")
    finally:
        handle.stop()


def test_single_kill_restart(redis_single_clean: RedisSingle) -> None:
    with redis_single_clean.client(retry=_no_retry(), socket_timeout=0.5) as client:
        client.set("k", "v")
        redis_single_clean.kill()
        with pytest.raises(redis.ConnectionError):
            client.get("k")
        redis_single_clean.restart()
        assert client.get("k") is None  # same URL answers again; no persistence


async def test_single_pause_times_out_then_recovers(redis_single_clean: RedisSingle) -> None:
    client = aioredis.Redis(
        host=redis_single_clean.host,
        port=redis_single_clean.port,
        socket_timeout=0.05,
        retry=_no_retry_async(),
        decode_responses=True,
    )
    try:
        await client.set("k", "v")
        redis_single_clean.pause()
        try:
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                await client.get("k")
            assert time.monotonic() - started < 0.5
        finally:
            redis_single_clean.resume()
        assert await client.get("k") == "v"
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- cluster


def test_cluster_eval_needs_common_hash_tag(redis_cluster_clean: RedisCluster) -> None:
    cluster = redis_cluster_clean
    assert re.fullmatch(r"redis\+cluster://127\.0\.0\.1:\d+", cluster.url)
    assert len(cluster.ports) == 3 and len(set(cluster.ports + cluster.bus_ports)) == 6
    print(f"cluster started in {cluster.startup_seconds:.3f}s")

    with SyncRedisCluster(host=cluster.host, port=cluster.seed_port) as client:
        assert client.eval(SET_BOTH, 2, "{u1}.a", "{u1}.b", "1", "2") == [b"1", b"2"]
        # redis-py refuses cross-slot EVAL before sending it ...
        with pytest.raises(redis.RedisClusterException, match="same key slot"):
            client.eval(SET_BOTH, 2, "u1.a", "u1.b", "1", "2")

    # ... and the server itself answers CROSSSLOT.
    assert key_slot(b"u1.a") != key_slot(b"u1.b")
    with cluster.node_client(0) as node:
        # redis-py strips the "CROSSSLOT" prefix and raises its own subclass.
        with pytest.raises(ClusterCrossSlotError) as excinfo:
            node.eval(SET_BOTH, 2, "u1.a", "u1.b", "1", "2")
        assert excinfo.value.status_code == "CROSSSLOT"


async def test_async_cluster_client_via_seed_node(redis_cluster_clean: RedisCluster) -> None:
    cluster = redis_cluster_clean
    client = AsyncRedisCluster(host=cluster.host, port=cluster.seed_port, decode_responses=True)
    try:
        await client.initialize()
        assert {node.port for node in client.get_nodes()} == set(cluster.ports)
        for i in range(60):
            await client.set(f"key-{i}", str(i))
        assert await client.eval(SET_BOTH, 2, "{u2}.a", "{u2}.b", "x", "y") == ["x", "y"]
    finally:
        await client.aclose()
    for index in range(len(cluster.ports)):  # the keys really spread over every master
        with cluster.node_client(index) as node:
            assert node.dbsize() > 0
    cluster.flushall()
    for index in range(len(cluster.ports)):
        with cluster.node_client(index) as node:
            assert node.dbsize() == 0


# --------------------------------------------------------------------------- sentinel


async def _until_replicated(topology: RedisSentinel, key: str) -> None:
    # Polling the replica rather than WAIT: on Redis 7.0, WAIT 1 sometimes blocks ~1 s
    # (until the replica's periodic ACK), longer than an app-like socket_timeout.
    replica = aioredis.Redis(host=topology.host, port=topology.replica_port)
    try:
        for _ in range(300):  # 3 s
            if await replica.exists(key):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{key!r} did not reach the replica")
    finally:
        await replica.aclose()


async def test_sentinel_failover(redis_sentinel_clean: RedisSentinel) -> None:
    topology = redis_sentinel_clean
    assert topology.url == f"redis+sentinel://127.0.0.1:{topology.sentinel_port}/{SENTINEL_SERVICE}"
    print(f"sentinel topology started in {topology.startup_seconds:.3f}s")
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        [(topology.host, topology.sentinel_port)], socket_timeout=0.5
    )
    master = sentinel.master_for(SENTINEL_SERVICE, socket_timeout=0.5, decode_responses=True)
    try:
        assert await sentinel.discover_master(SENTINEL_SERVICE) == (
            topology.host,
            topology.master_port,
        )
        await master.set("before", "1")
        await _until_replicated(topology, "before")  # so it survives the failover
        old_port = topology.master_port

        # An app-like writer keeps writing through the failover (own client, same sentinel).
        writer_client = sentinel.master_for(SENTINEL_SERVICE, socket_timeout=0.5)
        ok_at: list[float] = []
        failed = 0
        done = asyncio.Event()

        async def writer() -> None:
            nonlocal failed
            while not done.is_set():
                try:
                    await writer_client.incr("ticks")
                    ok_at.append(time.monotonic())
                except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
                    failed += 1
                await asyncio.sleep(0.01)

        writing = asyncio.create_task(writer())
        await asyncio.sleep(0.05)
        killed_at = time.monotonic()
        failover_s = await asyncio.to_thread(topology.failover)
        await asyncio.sleep(0.05)
        done.set()
        await writing
        await writer_client.aclose()

        assert topology.master_port != old_port
        assert await sentinel.discover_master(SENTINEL_SERVICE) == (
            topology.host,
            topology.master_port,
        )
        # The first client object finds the new master too (redis-py asks the sentinel again).
        await master.set("after", "2")
        assert await master.get("before") == "1"
        assert await master.get("after") == "2"
        after_kill = [t for t in ok_at if t > killed_at]
        assert after_kill, "no write succeeded after the failover"
        print(
            f"failover: master killed -> sentinel switched in {failover_s:.2f}s; "
            f"writer's first success {after_kill[0] - killed_at:.2f}s after the kill "
            f"({failed} failed calls, {len(ok_at)} ok)"
        )
    finally:
        await master.aclose()
        for s in sentinel.sentinels:
            await s.aclose()
