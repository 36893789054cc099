"""The script cache (extauthz/store/redis/wire.py): SCRIPT FLUSH mid-run, the one NOSCRIPT path.
"""

from __future__ import annotations

import asyncio

import pytest

from extauthz.store.base import BucketOp, LeaseOp, Op
from tests.store.conftest import Topology, make_redis_store, masters
from tests.store.redis.helpers import BUCKET, FLEET


def flush_scripts(topology: Topology) -> None:
    for client in masters(topology):
        with client:
            client.script_flush()


@pytest.mark.redis
@pytest.mark.parametrize("batching", [True, False], ids=["batching", "single-calls"])
@pytest.mark.parametrize("topology_fixture", ["redis_single_clean", "redis_cluster_clean"])
async def test_script_flush_mid_run(request: pytest.FixtureRequest, topology_fixture: str,
                                    batching: bool) -> None:
    topology: Topology = request.getfixturevalue(topology_fixture)
    store = make_redis_store(topology, batching=batching)
    ops: list[Op] = [BucketOp(BUCKET, 0.001, 1000, 1), LeaseOp(FLEET, 0, 30)]
    try:
        assert (await store.check(ops, "warm")).admitted  # scripts loaded once, up front
        loads = store.stats.script_loads
        admitted = 1
        for rnd in range(4):
            checks = [store.check(ops, f"{rnd}-{i}") for i in range(40)]
            flush = asyncio.to_thread(flush_scripts, topology)  # lands while checks run
            *results, _ = await asyncio.gather(*checks, flush)
            admitted += sum(r.admitted for r in results)
            flush_scripts(topology)
        assert admitted == 161
        assert await store.inflight([FLEET]) == [161]
        assert await store.release([FLEET], "3-39") == 1
        # Loaded again after each flush (a round starts right after one: at least 3 times).
        assert store.stats.script_loads - loads >= 3
    finally:
        await store.close()

