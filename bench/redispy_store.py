"""The Redis store over redis-py's own connections instead of the lean client path
(``extauthz/store/redis/conn.py``): what ``python -m bench.store_bench`` measures the lean
path against (``redis-py+batch``). The package has no use for it, so it lives here.

Only the sending differs: scripts loaded with redis-py's commands, a single Redis batch
written on one pooled redis-py connection, a cluster batch through redis-py's cluster
pipeline (:meth:`RedisStore._pipeline_client`, which the package uses for a batch of no
known master).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from extauthz.store.redis.batcher import Call
from extauthz.store.redis.store import RedisStore, _packed_calls
from extauthz.store.redis.wire import Script, send_reloading


class RedisPyStore(RedisStore):
    """:class:`RedisStore` sending over redis-py's connections (build it with ``from_url``)."""

    lean = False

    async def _initialize(self) -> None:
        scripts = list(self._scripts.values())
        if isinstance(self.client, RedisCluster):
            self.stats.round_trips += 1
            await self.client.initialize()
            # best effort, as the package's: a master down must not keep the others idle
            await asyncio.gather(*(self.client.script_load(s.source) for s in scripts),
                                 return_exceptions=True)
        else:
            pipe = self.client.pipeline(transaction=False)
            for script in scripts:
                pipe.script_load(script.source)
            await pipe.execute()
        self.stats.round_trips += 1
        self.stats.script_loads += len(scripts)
        self._ready = True

    async def _script_load(self, script: Script, node: ClusterNode | None) -> None:
        self.stats.script_loads += 1
        self.stats.round_trips += 1
        if node is None:
            await self.client.script_load(script.source)
        else:
            await self.client.execute_command("SCRIPT LOAD", script.source, target_nodes=node)

    async def _raw_pipeline(self, batch: Sequence[Call]) -> list[Any]:
        """The batch's EVALSHAs packed and written at once on one pooled connection, one
        reply per call (error replies in place)."""
        assert isinstance(self.client, Redis)
        pool = self.client.connection_pool

        async def send(todo: list[int]) -> list[Any]:
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]
            answers: list[Any] = []
            try:
                await conn.send_packed_command(_packed_calls(batch, todo))
                for _ in todo:
                    try:
                        answers.append(await conn.read_response())
                    except rx.ResponseError as exc:  # this call's error; the stream goes on
                        answers.append(exc)
            except BaseException:
                # A half-read stream must never go back to the pool (redis-py disconnects
                # on its own errors; this covers every other way out).
                await conn.disconnect(nowait=True)
                raise
            finally:
                await pool.release(conn)
            return answers

        return await send_reloading([call.script for call in batch], send,
                                    lambda script: self._script_load(script, None), self.stats)

    async def _pipeline_on(self, batch: Sequence[Call], node: ClusterNode | None) -> list[Any]:
        return await self._pipeline_client(batch, node)
