"""Redis Cluster (extauthz/store/redis/cluster.py): groups by hash tag, compensation.
"""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.crc import key_slot

from extauthz.core.errors import StoreUnavailable
from extauthz.store.base import LeaseOp
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import RedisCluster
from tests.store.conftest import make_redis_store
from tests.store.redis.helpers import FLEET, USER_LEASES


@pytest.mark.redis
async def test_cluster_gives_back_a_fleet_lease_of_a_request_refused_per_user(
    redis_cluster_clean: RedisCluster,
) -> None:
    store = make_redis_store(redis_cluster_clean)
    try:
        user = LeaseOp(USER_LEASES, 1, 30)
        fleet = LeaseOp(FLEET, 10, 30)
        assert (await store.check([user, fleet], "holder")).admitted
        assert store.stats.compensations == 0
        refused = await store.check([fleet, user], "refused")
        assert not refused.admitted
        assert [r.allowed for r in refused.results] == [True, False]
        assert refused.results[0].extra == 1.0  # reported as not held
        assert store.stats.compensations == 1
        assert await store.inflight([FLEET, USER_LEASES]) == [1, 1]
        assert await store.release([FLEET], "refused") == 0
        assert key_slot(USER_LEASES.encode()) != key_slot(FLEET.encode())  # two script calls
    finally:
        await store.close()


@pytest.mark.redis
async def test_cluster_group_failure_is_compensated_and_reported(
    redis_cluster_clean: RedisCluster,
) -> None:
    """A master is down when a fresh store starts: requests on healthy slots are served; a
    request whose user slot is on the dead master raises StoreUnavailable (the engine then
    fails open) and its fleet-slot commit is given back first."""
    cluster = redis_cluster_clean
    url = "redis+cluster://" + ",".join(f"{cluster.host}:{port}" for port in cluster.ports)
    probe = RedisStore.from_url(url)
    try:
        await probe.ping()
        assert isinstance(probe.client, AsyncRedisCluster)
        fleet_node = probe.client.get_node_from_key(FLEET)
        user_node = probe.client.get_node_from_key(USER_LEASES)
        assert fleet_node is not None and user_node is not None
        assert fleet_node.name != user_node.name  # true for these key names
    finally:
        await probe.close()
    # Quick: past cluster-node-timeout (2 s) the cluster would refuse every slot.
    cluster.nodes[cluster.ports.index(int(user_node.port))].kill()
    store = RedisStore.from_url(url)
    try:
        assert (await store.check([LeaseOp(FLEET, 10, 30)], "healthy")).admitted
        with pytest.raises(StoreUnavailable):
            await store.check([LeaseOp(FLEET, 10, 30), LeaseOp(USER_LEASES, 10, 30)], "x")
        assert store.stats.compensations == 1
        assert await store.inflight([FLEET]) == [1]  # "healthy" only
    finally:
        await store.close()

