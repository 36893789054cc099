"""The Redis store: the store contract (:mod:`extauthz.store.base`) on a Redis shared by
every replica, so that one budget holds across the fleet.

* Every operation is one Lua script (``lua/*.lua``, shipped as ``extauthz.lua``), called
  by SHA and loaded again when Redis answers NOSCRIPT (``SCRIPT FLUSH``, failover,
  restart): :mod:`.wire`. A check evaluates every op of the request in one ``check.lua``
  call, which the batcher shares with the other checks of its batch and with the releases
  waiting for them (a release is a ``check.lua`` entry too).
* "now" is Redis ``TIME`` inside the script (one clock for every replica) unless a clock
  is injected (``now=``, tests): its value is then passed as ``ARGV[1]``.
* Redis Cluster: :mod:`.cluster` (groups by hash tag, compensation).
* Auto-batching (default on): :mod:`.batcher`.
* Client exceptions are wrapped once (:func:`.wire.wrap`) into
  :class:`~extauthz.core.errors.StoreTimeout` and :class:`~extauthz.core.errors.StoreUnavailable`.
  Nothing here decides fail-open: the engine does.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.sentinel import Sentinel

from ...core.errors import StoreError, StoreUnavailable
from ...core.settings import STORE_DEADLINE_MS
from .. import algorithms, redis_events
from ..base import CheckResult, Op, PeekOp, ShedParams, StoreBase, StoreStats
from ..keys import Keys
from . import cluster
from .batcher import Batcher, Call, written
from .conn import NodeConnection
from .url import Client, connect
from .wire import (
    CLIENT_ERRORS,
    SCRIPT_NAMES,
    Reply,
    Script,
    check_args,
    check_result,
    load_script,
    num,
    pack_command,
    pack_evalsha,
    release_args,
    released,
    send_reloading,
    wrap,
)

__all__ = ["RedisStore"]

#: compare-and-set attempts of one shed controller step (each retry follows another
#: replica's step; replicas sample seconds apart, so a second attempt is already rare)
_SHED_ATTEMPTS: Final = 8


class RedisStore(StoreBase):
    """The store contract on Redis, Redis Cluster or Sentinel. Build it with :meth:`from_url`."""

    #: script calls go over the lean client path (:mod:`.conn`); the benchmark's store over
    #: redis-py's connections (bench/redispy_store.py) says False
    lean: bool = True

    def __init__(
        self,
        client: Client,
        *,
        name: str = "redis",
        now: Callable[[], float] | None = None,
        batching: bool = True,
        sentinel: Sentinel | None = None,
        releases_ride: bool = True,
    ) -> None:
        self.name = name
        self.client = client
        self.stats: StoreStats = StoreStats()
        self._cluster = isinstance(client, RedisCluster)
        #: several masters (Redis Cluster): the engine keeps a breaker per master (node_of)
        self.per_master = self._cluster
        self._now = now
        self._sentinel = sentinel
        self._scripts = {name: load_script(name) for name in SCRIPT_NAMES}
        self._batcher = Batcher(self._transmit, batching=batching,
                                split=self._by_master if self._cluster else None)
        #: see _ensure_ready
        self._ready = False
        self._init_task: asyncio.Task[None] | None = None
        #: releases wait (a few ms) for the next check's round trip (batcher riders)
        self.releases_ride = releases_ride
        #: the lean client path (:mod:`.conn`), one connection per node (key: node name);
        #: bench/redispy_store.py measures it against redis-py's own connections
        self._nodes: dict[str, NodeConnection] = {}
        #: the script calls (a key of each, the call) of each check under way, by lease id:
        #: one, or on a cluster one per slot group (see :meth:`waiting`)
        self._checks: dict[str, list[tuple[str, Call]]] = {}

    @property
    def batching(self) -> bool:
        return self._batcher.batching

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        deadline: float = STORE_DEADLINE_MS / 1000.0,
        now: Callable[[], float] | None = None,
        batching: bool | None = None,
        releases_ride: bool = True,
        **kw: Any,
    ) -> RedisStore:
        """A store for ``url`` (see :func:`.url.connect` and ``docs/redis.md``).

        ``deadline`` is the engine's per-call deadline (socket timeouts derive from it);
        ``batching`` (default on; also the URL query option ``batching=false``) pipelines
        the checks of one event-loop iteration; script calls go over :mod:`.conn`;
        ``releases_ride`` (default on) sends releases with the next check (off only to
        measure it).
        ``kw`` goes to the redis-py client.
        """
        conn = connect(url, deadline=deadline, batching=batching, **kw)
        return cls(conn.client, name=conn.name, now=now, batching=conn.batching,
                   sentinel=conn.sentinel, releases_ride=releases_ride)

    # -- sending ------------------------------------------------------------------------
    def _now_arg(self) -> str:
        return "" if self._now is None else repr(float(self._now()))

    def _submit(self, script: str, keys: Sequence[str], args: Sequence[str | bytes],
                *, droppable: bool = False, ride: bool = False) -> asyncio.Future[Reply]:
        """Queue a script call. Calls of a script that merges (``wire.MERGES``: check.lua,
        whose entries are checks and releases) share one call with the others of their
        batch, per hash tag on a cluster (one script call must stay in one slot)."""
        return self._submit_call(script, keys, args, droppable=droppable, ride=ride).future

    def _submit_call(self, script: str, keys: Sequence[str], args: Sequence[str | bytes],
                     *, droppable: bool = False, ride: bool = False) -> Call:
        s = self._scripts[script]
        merge = None if s.merge is None else Keys.tag_of(keys[0]) if self._cluster else ""
        return self._batcher.submit_call(s, keys, args, droppable=droppable, ride=ride, merge=merge)

    async def _ensure_ready(self) -> None:
        """Once per store, before the first command: a cluster client initialized alone
        (redis-py 8's lazy initialization races when many calls start it together), and
        every script loaded (a cold start then sends no NOSCRIPT round trips). Concurrent
        callers share one attempt; a failed attempt is retried by the next call."""
        if self._ready:
            return
        task = self._init_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._init_task = self._batcher.spawn(self._initialize())
        await asyncio.shield(task)

    async def _initialize(self) -> None:
        scripts = list(self._scripts.values())
        data = b"".join(pack_command("SCRIPT", "LOAD", s.source) for s in scripts)
        if isinstance(self.client, RedisCluster):
            self.stats.round_trips += 1
            await self.client.initialize()
            # Best effort: with a master down the load fails there, and the healthy masters
            # must still serve (NOSCRIPT loads a script where it is missing). Over the lean
            # connections, opened here: one per master.
            await asyncio.gather(*(self._cluster_node(node).call(data, len(scripts))
                                   for node in self.client.get_primaries()),
                                 return_exceptions=True)
        else:
            # The lean connection opened here, with the scripts: the first checks need
            # no connect of their own.
            for reply in await self._single_node().call(data, len(scripts)):
                if isinstance(reply, BaseException):
                    raise reply
        self.stats.round_trips += 1
        self.stats.script_loads += len(scripts)
        self._ready = True

    async def _transmit(self, batch: list[Call]) -> list[Reply]:
        """The batcher's way out: one round trip (per cluster master) for ``batch``."""
        await self._ensure_ready()
        if isinstance(self.client, RedisCluster):
            return await cluster.pipeline_by_node(
                self.client, [call.keys for call in batch],
                lambda idx, node: self._pipeline_on([batch[i] for i in idx], node))
        return await self._raw_pipeline(batch)

    def _by_master(self, batch: list[Call]) -> list[list[Call]]:
        """Redis Cluster: a batch's calls per master (the batcher sends and delivers each
        part on its own, so that a slow master delays only its own calls)."""
        parts: dict[str, list[Call]] = {}
        for call in batch:
            parts.setdefault(self.node_of(call.keys[0]), []).append(call)
        return list(parts.values())

    def node_of(self, key: str) -> str:
        """The name (``host:port``) of the master serving ``key``; "" on a single Redis or
        Sentinel (one master), or when no master covers the key's slot."""
        if not self._cluster:
            return ""
        node = cluster.node_of(self.client, key)
        return "" if node is None else str(node.name)

    def waiting(self, lease_id: str) -> list[tuple[str, float | None]]:
        """The parts of the check ``lease_id`` that Redis has not answered: for each, its
        master (:meth:`node_of`) and how long (seconds) it has waited since it was written,
        or None while it is still queued here (not written yet: this server's own delay).
        A reply already read counts as answered even if the check has not seen it yet (the
        server's busy loop has not carried it). On a cluster a check has one part per slot
        group, each written to its own master."""
        parts = self._checks.get(lease_id)
        if not parts:
            return []
        now = time.monotonic()
        return [(self.node_of(key), now - call.written if call.written else None)
                for key, call in parts if not call.answered()]

    async def _script_load(self, script: Script, node: ClusterNode | None) -> None:
        """SCRIPT LOAD where NOSCRIPT came from: on a cluster that node only, so that one
        dead master cannot keep scripts off the others."""
        self.stats.script_loads += 1
        self.stats.round_trips += 1
        target = self._single_node() if node is None else self._cluster_node(node)
        reply, = await target.call(pack_command("SCRIPT", "LOAD", script.source), 1)
        if isinstance(reply, BaseException):
            raise reply

    async def _raw_pipeline(self, batch: Sequence[Call]) -> list[Any]:
        """Single Redis and Sentinel: the batch's EVALSHAs packed here and written at once
        over the lean connection (:mod:`.conn`), one reply per call (error replies in
        place, like a pipeline's ``raise_on_error=False``)."""
        async def send_lean(todo: list[int]) -> list[Any]:
            return await self._single_node().call(_packed_calls(batch, todo), len(todo), late=True,
                                                  sent=_stamp(batch, todo))

        return await send_reloading([call.script for call in batch], send_lean,
                                    lambda script: self._script_load(script, None), self.stats)

    def _single_node(self) -> NodeConnection:
        """Single Redis and Sentinel: the one lean connection (to the current master)."""
        assert isinstance(self.client, Redis)
        return self._node("", self.client.connection_pool.make_connection)

    def _cluster_node(self, node: ClusterNode) -> NodeConnection:
        """Redis Cluster: the lean connection to one master."""
        return self._node(node.name, lambda: node.connection_class(**node.connection_kwargs))

    def _node(self, name: str, make: Callable[[], AbstractConnection]) -> NodeConnection:
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = NodeConnection(make)
        return node

    async def _pipeline_on(self, batch: Sequence[Call], node: ClusterNode | None) -> list[Any]:
        """Redis Cluster, one master: the calls over the lean connection to it (a batch of
        no known master through redis-py's client: :meth:`_pipeline_client`)."""
        if node is None:
            return await self._pipeline_client(batch, node)
        assert isinstance(self.client, RedisCluster)
        client = self.client

        async def send_lean(todo: list[int]) -> list[Any]:
            answers = await self._cluster_node(node).call(_packed_calls(batch, todo), len(todo),
                                                          late=True, sent=_stamp(batch, todo))
            # MOVED/ASK (slots moved since the map was read): that call once more through
            # redis-py, which follows the redirection and refreshes its slot map.
            for j, answer in enumerate(answers):
                if isinstance(answer, rx.ResponseError) and str(answer).startswith(("MOVED", "ASK")):
                    call = batch[todo[j]]
                    try:
                        answers[j] = await client.execute_command(
                            "EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
                    except rx.ResponseError as exc:
                        answers[j] = exc
            return list(answers)

        return await send_reloading([call.script for call in batch], send_lean,
                                    lambda script: self._script_load(script, node), self.stats)

    async def _pipeline_client(self, batch: Sequence[Call], node: ClusterNode | None) -> list[Any]:
        """Redis Cluster through redis-py's client: the calls as one pipeline of EVALSHAs
        (``transaction=False``), or one plain call (cheaper than a one-command pipeline)."""
        assert isinstance(self.client, RedisCluster)
        client = self.client

        async def send(todo: list[int]) -> list[Any]:
            if len(batch) == 1:
                call = batch[0]
                try:
                    return [await client.evalsha(call.script.sha, len(call.keys), *call.keys,
                                                 *call.args)]
                except rx.NoScriptError as exc:
                    return [exc]
            pipe = client.pipeline(transaction=False)
            for i in todo:
                call = batch[i]
                # execute_command: redis-py's ClusterPipeline blocks the evalsha() method
                # (the slot is found from numkeys all the same; every call is one slot).
                pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys,
                                     *call.args)
            return list(await pipe.execute(raise_on_error=False))

        return await send_reloading([call.script for call in batch], send,
                                    lambda script: self._script_load(script, node), self.stats)

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[str | bytes]) -> Reply:
        return await self._submit(script, keys, args)

    # -- contract -----------------------------------------------------------------------
    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        if not ops:
            return CheckResult(True, ())
        if self._cluster and len(groups := cluster.group_by_tag([op.key for op in ops])) > 1:
            return await self._check_groups(ops, groups, lease_id)
        keys, args = self._check_args(ops, lease_id)
        try:
            if algorithms.rides(ops):
                # batched grants given back: they ride with the next check, as releases do
                reply = await self._submit("check", keys, args, ride=self.releases_ride)
            else:
                call = self._submit_call("check", keys, args, droppable=True)
                if lease_id:  # the engine's checks: their wait is told by waiting()
                    self._checks[lease_id] = [(keys[0], call)]
                    try:
                        reply = await call.future
                    finally:
                        self._checks.pop(lease_id, None)
                else:
                    reply = await call.future
        except StoreError as exc:
            if exc.late is not None:  # sent, unanswered: its answer may still come
                exc.late = self._settled(exc.late, keys[0], functools.partial(check_result, ops))
            raise
        return check_result(ops, reply)

    def _check_args(self, ops: Sequence[Op], lease_id: str) -> tuple[list[str], list[str | bytes]]:
        return check_args(self._now_arg(), ops, lease_id)

    async def _check_groups(self, ops: Sequence[Op], groups: list[list[int]],
                            lease_id: str) -> CheckResult:
        """Redis Cluster, ops in several slots: run in a task the caller cannot cancel, so
        that a compensation always completes. (A caller that gives up loses the answer: the
        engine's release path gives back what an abandoned answer committed.)"""
        parts = self._checks[lease_id] = []

        def submit(script: str, keys: Sequence[str], args: Sequence[str | bytes]) -> asyncio.Future[Reply]:
            part = self._submit_call(script, keys, args)
            parts.append((keys[0], part))
            return part.future

        task = self._batcher.spawn(
            cluster.check_groups(submit, self._check_args, self.stats, ops, groups,
                                 lease_id, self._settled))
        task.add_done_callback(lambda _: self._checks.pop(lease_id, None))
        result: CheckResult = await asyncio.shield(task)
        return result

    def _settled(self, late: asyncio.Future[Reply], key: str,
                 then: Callable[[Reply], Any]) -> asyncio.Future[Any]:
        """``then(the late answer)`` once it came *and* the store answers again (a connection
        to the node of ``key`` is open), so that what follows from it (a release) is sent,
        not refused as "not connected"; in a store-owned task (which also runs ``then``'s
        coroutine when it returns one)."""
        out: asyncio.Future[Any] = late.get_loop().create_future()

        async def settle() -> None:
            try:
                reply = await late
                node = self._node_of(key)
                if node is not None:
                    await node.opened()
                value = then(reply)
                if asyncio.iscoroutine(value):  # work to do with it (a compensation)
                    value = await value
                out.set_result(value)
            except Exception as exc:
                out.set_exception(exc)
                out.exception()  # retrieved: nobody may wait for it

        self._batcher.spawn(settle())
        return out

    def _node_of(self, key: str) -> NodeConnection | None:
        """The lean connection serving ``key`` (None: not opened yet)."""
        if not self._cluster:
            return self._nodes.get("")
        node = cluster.node_of(self.client, key)
        return None if node is None else self._nodes.get(node.name)

    async def release(self, keys: Sequence[str], lease_id: str) -> int:
        """Releases ride with checks (:data:`.batcher.RIDE_FLUSH_DELAY`): a release is a
        ``check.lua`` entry (ops ``r``), so it goes out in the same script call as the next
        check of its slot group, with no round trip and no EVALSHA of its own under load."""
        if not keys:
            return 0
        groups = cluster.group_by_tag(keys) if self._cluster else [list(range(len(keys)))]
        replies = await asyncio.gather(*(
            self._submit("check", *release_args(self._now_arg(), [keys[i] for i in g], lease_id),
                         ride=self.releases_ride)
            for g in groups))
        return sum(released(reply) for reply in replies)

    async def inflight(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        now = self._now_arg()
        if not self._cluster:
            return [int(c) for c in await self._run("inflight", keys, [now])]
        groups = cluster.group_by_tag(keys)
        replies = await asyncio.gather(
            *(self._run("inflight", [keys[i] for i in g], [now]) for g in groups)
        )
        out = [0] * len(keys)
        for group, reply in zip(groups, replies, strict=True):
            for i, count in zip(group, reply, strict=True):
                out[i] = int(count)
        return out

    async def peek(self, ops: Sequence[PeekOp]) -> list[float]:
        """``lua/peek.lua`` (read-only commands); on a cluster one call per hash tag."""
        if not ops:
            return []
        now = self._now_arg()
        keys = [op.key for op in ops]
        groups = cluster.group_by_tag(keys) if self._cluster else [list(range(len(ops)))]
        out = [0.0] * len(ops)
        for group in groups:
            args: list[str | bytes] = [now]
            for i in group:
                op = ops[i]
                args += [_PEEK_KINDS[op.kind], repr(float(op.rate)), repr(float(op.burst))]
            reply = await self._run("peek", [keys[i] for i in group], args)
            for i, value in zip(group, reply, strict=True):
                out[i] = float(value)
        return out

    async def get_value(self, key: str) -> str | None:
        try:
            await self._ensure_ready()
            value = await self.client.get(key)
        except CLIENT_ERRORS as exc:
            raise wrap(exc) from exc
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    async def set_value(self, key: str, value: str | None, ttl: float | None = None) -> None:
        try:
            await self._ensure_ready()
            if value is None or (ttl is not None and ttl <= 0):
                await self.client.delete(key)
            elif ttl is None:
                await self.client.set(key, value)
            else:
                await self.client.set(key, value, px=max(1, math.ceil(ttl * 1000)))
        except CLIENT_ERRORS as exc:
            raise wrap(exc) from exc

    async def swap_value(self, key: str, expected: str | None, value: str | None,
                         ttl: float | None = None) -> bool:
        """``swap_value.lua``: operator changes (switches, overrides), not the check path."""
        reply = await self._run("swap_value", [key], [
            "0" if expected is None else "1", expected or "", "0" if value is None else "1",
            value or "", "0" if ttl is None else str(max(1, math.ceil(ttl * 1000)))])
        return int(reply) == 1

    async def shed_update(self, key: str, utilization: float, params: ShedParams) -> float:
        """One step of the controller (:func:`~extauthz.store.algorithms.shed_advance`, the
        embedded store's code) from the fleet's state, swapped in with a compare-and-set
        (``shed_state.lua``). When another replica stepped in between, the CAS fails and
        returns that replica's state: the step is taken again from it, so replicas move the
        level at one controller's pace."""
        reply = await self._run("shed_state", [key], [self._now_arg(), "get"])
        for _ in range(_SHED_ATTEMPTS):
            _, level, last, now = (v.decode() if isinstance(v, bytes) else str(v) for v in reply)
            new = algorithms.shed_advance(float(level) if level else None,
                                          float(last) if last else None, float(now),
                                          utilization, params)
            reply = await self._run("shed_state", [key], [
                self._now_arg(), "set", level, last, num(new), num(float(now)), num(params.ttl),
            ])
            if int(reply[0]) == 1:
                return new
        raise StoreUnavailable(f"redis: shed state {key} changed under {_SHED_ATTEMPTS} attempts in a row")

    async def append_events(self, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
        await self._prepared()
        await redis_events.append_events(self.client, key, events, maxlen, ttl)

    async def read_events(self, key: str, since: float) -> list[str]:
        await self._prepared()
        return await redis_events.read_events(self.client, key, since)

    async def _prepared(self) -> None:
        try:
            await self._ensure_ready()
        except CLIENT_ERRORS as exc:
            raise wrap(exc) from exc

    async def ping(self) -> None:
        try:
            await self._ensure_ready()
            await self.client.ping()
        except CLIENT_ERRORS as exc:
            raise wrap(exc) from exc

    async def close(self) -> None:
        if self._batcher.closed:
            return
        await self._batcher.close()
        for node in self._nodes.values():
            await node.close()
        await self.client.aclose()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                await sentinel.aclose()


#: PeekOp.kind -> lua/peek.lua's op code
_PEEK_KINDS = {"bucket": "b", "count": "q", "leases": "l"}


def _stamp(batch: Sequence[Call], todo: Sequence[int]) -> Callable[[list[asyncio.Future[Any]]], None]:
    """The lean connection's ``sent`` hook: ``batch[i]`` for ``i`` in ``todo`` written now,
    with their replies' futures (:func:`.batcher.written`)."""
    return lambda replies: written([batch[i] for i in todo], replies)


def _packed_calls(batch: Sequence[Call], todo: Sequence[int]) -> bytes:
    """The EVALSHAs of ``batch[i]`` for ``i`` in ``todo``, packed for one write."""
    return b"".join(pack_evalsha(batch[i].script.sha.encode(), batch[i].keys, batch[i].args)
                    for i in todo)
