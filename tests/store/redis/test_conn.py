"""The lean client path (extauthz/store/redis/conn.py) on both event loops.
"""

from __future__ import annotations

import asyncio

import pytest

from extauthz.core.errors import StoreUnavailable
from extauthz.store.base import BucketOp
from testinfra.redis_servers import RedisSingle
from tests.store.conftest import make_redis_store
from tests.store.redis.helpers import K


@pytest.mark.redis
@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_lean_connection_pipelines_reconnects_and_recovers_scripts(
    redis_single_clean: RedisSingle, use_uvloop: bool
) -> None:
    """The lean path (store/redis/conn.py) on both event loops the server runs on: one
    connection carries concurrent batches in order, a Redis restart (scripts gone) is
    survived by one reconnect (in the background) and the NOSCRIPT path, and nothing else
    opens a connection."""
    import uvloop

    async def scenario() -> None:
        store = make_redis_store(redis_single_clean)
        assert store.lean
        try:
            checks = await asyncio.gather(*(
                store.check([BucketOp(K.bucket("lean", f"u{i % 7}"), 0.001, 10, 1)], f"l{i}")
                for i in range(70)))
            assert sorted(c.results[0].remaining for c in checks) == pytest.approx(sorted(
                float(n) for _ in range(7) for n in range(10)), abs=0.01)
            assert store._nodes[""].connects == 1
            loads = store.stats.script_loads
            redis_single_clean.restart()
            # Calls fail at once until the background reconnect (started by the first call
            # that finds the connection lost) is done; a failed call commits nothing.
            for _ in range(250):
                try:
                    result = await store.check([BucketOp(K.bucket("lean", "after"), 1, 10, 1)], "y")
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.02)
            else:
                pytest.fail("no reconnect within 5 s of the restart")
            assert result.admitted and result.results[0].remaining == pytest.approx(9.0, abs=0.01)
            assert store._nodes[""].connects == 2
            assert store.stats.script_loads == loads + 1  # NOSCRIPT: check.lua loaded again
        finally:
            await store.close()

    (uvloop.run if use_uvloop else asyncio.run)(scenario())

