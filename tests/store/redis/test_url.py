"""Redis URLs (extauthz/store/redis/url.py): forms, and a password.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool

from extauthz.core.errors import StoreUnavailable
from extauthz.store.base import BucketOp
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import start_single
from tests.store.redis.helpers import BUCKET


@pytest.mark.redis
async def test_url_with_password(tmp_path: Path) -> None:
    handle = start_single(tmp_path, password="s3cret")
    try:
        store = RedisStore.from_url(handle.url)
        try:
            await store.ping()
            assert (await store.check([BucketOp(BUCKET, 1, 2, 1)], "a")).admitted
        finally:
            await store.close()
        anonymous = RedisStore.from_url(f"redis://{handle.host}:{handle.port}/0")
        try:
            with pytest.raises(StoreUnavailable):
                await anonymous.check([BucketOp(BUCKET, 1, 2, 1)], "a")
        finally:
            await anonymous.close()
    finally:
        handle.stop()


async def test_url_forms() -> None:
    """Parsing only: the clients connect lazily."""
    single = RedisStore.from_url("redis://:pw@db.example:6380/2", deadline=0.01)
    kw = single.client.connection_pool.connection_kwargs
    assert (single.name, kw["host"], kw["port"], kw["db"], kw["password"]) == (
        "redis", "db.example", 6380, 2, "pw")
    assert kw["socket_timeout"] == 0.5  # 50 x the deadline, at least 0.25 s

    tls = RedisStore.from_url("rediss://u:pw@db.example:6390/0?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem")
    pool = tls.client.connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"
    assert pool.connection_kwargs["username"] == "u"

    cluster = RedisStore.from_url("rediss+cluster://:pw@n1.example:7000,n2.example:7001?ssl_cert_reqs=none")
    assert cluster.name == "redis-cluster"
    assert isinstance(cluster.client, AsyncRedisCluster)
    startup = cluster.client.nodes_manager.startup_nodes
    assert sorted(startup) == ["n1.example:7000", "n2.example:7001"]
    node_kw = next(iter(startup.values())).connection_kwargs
    assert node_kw["password"] == "pw"
    assert node_kw["ssl_cert_reqs"] == "none"

    sentinel = RedisStore.from_url("redis+sentinel://:pw@s1.example:26379,s2.example:26380/mymaster/3")
    assert sentinel.name == "redis-sentinel"
    spool = sentinel.client.connection_pool
    assert isinstance(spool, SentinelConnectionPool)
    assert (spool.service_name, spool.connection_kwargs["db"], spool.connection_kwargs["password"]) == (
        "mymaster", 3, "pw")
    assert sentinel._sentinel is not None
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinel._sentinel.sentinels] == [
        26379, 26380]

    tls_sentinel = RedisStore.from_url("rediss+sentinel://s1.example:26379/mymaster?ssl_cert_reqs=none")
    tls_pool = tls_sentinel.client.connection_pool
    assert tls_pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    assert tls_pool.connection_kwargs["ssl_cert_reqs"] == "none"

    assert single.batching and cluster.batching
    unbatched = RedisStore.from_url("redis+cluster://n1.example:7000?batching=false")
    assert not unbatched.batching
    assert "batching" not in next(iter(unbatched.client.nodes_manager.startup_nodes.values())).connection_kwargs
    plain = RedisStore.from_url("redis://db.example:6379/0?batching=off&socket_keepalive=true")
    assert not plain.batching
    assert "batching" not in plain.client.connection_pool.connection_kwargs

    for store in (single, tls, cluster, sentinel, unbatched, plain, tls_sentinel):
        await store.close()
    for bad in ("http://x", "redis+mesh://x:1", "redis+sentinel://s:26379", "redis+cluster://"):
        with pytest.raises(ValueError):
            RedisStore.from_url(bad)

