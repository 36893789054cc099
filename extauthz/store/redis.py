"""The Redis store: the store contract (:mod:`extauthz.store.base`) on a Redis shared by
every replica, so that one budget holds across the fleet.

* Every operation is one Lua script (``lua/*.lua``, shipped as ``extauthz.lua``), called
  by SHA and loaded again when Redis answers NOSCRIPT (``SCRIPT FLUSH``, failover,
  restart). A check evaluates every op of the request in one ``check.lua`` call.
* "now" is Redis ``TIME`` inside the script (one clock for every replica) unless a clock
  is injected (``now=``, tests): its value is then passed as ``ARGV[1]``.
* Redis Cluster: ops are grouped by hash tag (per-user keys ``{u:<hash>}``, fleet keys
  ``{fleet}``); the groups are evaluated concurrently, and when one group committed while
  another refused, ``compensate.lua`` gives the commit back before the check returns.
* Auto-batching (default on): script calls issued in the same event-loop iteration are
  sent together as one pipeline (``transaction=False``): one round trip for all of them.
* Calls are sent by store-owned tasks and the caller awaits a future, so a caller
  cancelled by the engine's deadline never interrupts a read on a pooled connection; when
  the reply of such an abandoned check shows leases taken, they are released at once
  (the engine failed that request open and will never release them).
* Client exceptions are wrapped once, here, into :class:`~extauthz.errors.StoreTimeout`
  and :class:`~extauthz.errors.StoreUnavailable`. Nothing here decides fail-open: the
  engine does.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.resources
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from redis import exceptions as rx
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from ..errors import StoreError, StoreTimeout, StoreUnavailable
from . import redis_events
from .base import BucketOp, CheckResult, LeaseOp, Op, OpResult, ShedParams
from .keys import Keys

__all__ = ["SCRIPT_NAMES", "RedisStore", "Script", "StoreStats", "load_script"]

SCRIPT_NAMES: Final = ("check", "release", "inflight", "shed_update", "compensate")

#: EVALSHA attempts while Redis answers NOSCRIPT (each after a SCRIPT LOAD): a flush that
#: lands between the load and the resend, or one per cluster node, is survived.
_NOSCRIPT_ATTEMPTS: Final = 4

#: Errors from the client that mean "Redis could not answer" (wrapped into StoreError).
_CLIENT_ERRORS: Final = (rx.RedisError, rx.RedisClusterException, OSError)

Client = Redis | RedisCluster
Reply = Any


# --------------------------------------------------------------------------- scripts


@dataclass(frozen=True, slots=True)
class Script:
    """One Lua script: its source and SHA1 (what EVALSHA names it by)."""

    name: str
    source: bytes
    sha: str

    @classmethod
    def of(cls, name: str, source: bytes) -> Script:
        return cls(name, source, hashlib.sha1(source, usedforsecurity=False).hexdigest())


def load_script(name: str) -> Script:
    """Read ``<name>.lua`` from the ``extauthz.lua`` package data."""
    source = importlib.resources.files("extauthz.lua").joinpath(f"{name}.lua").read_bytes()
    return Script.of(name, source)


# --------------------------------------------------------------------------- helpers


def _wrap(exc: BaseException) -> StoreError:
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, rx.TimeoutError):
        return StoreTimeout(f"redis: {exc}")
    return StoreUnavailable(f"redis: {type(exc).__name__}: {exc}")


def _num(x: float) -> str:
    return repr(float(x))


def _op_args(op: Op) -> tuple[bytes, ...]:
    """The 5 ARGV check.lua reads per op (see its header)."""
    if isinstance(op, BucketOp):
        return _bucket_args(op.enforce, op.rate, op.burst, op.cost)
    return _lease_args(op.enforce, op.limit, op.ttl)


@functools.lru_cache(maxsize=4096)
def _bucket_args(enforce: bool, rate: float, burst: float, cost: float) -> tuple[bytes, ...]:
    return (b"b", b"1" if enforce else b"0", _num(rate).encode(), _num(burst).encode(),
            _num(cost).encode())


@functools.lru_cache(maxsize=4096)
def _lease_args(enforce: bool, limit: int, ttl: float) -> tuple[bytes, ...]:
    return (b"l", b"1" if enforce else b"0", str(int(limit)).encode(), _num(ttl).encode(), b"")


def _bulk(arg: str | bytes) -> bytes:
    data = arg if isinstance(arg, bytes) else arg.encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _pack_evalsha(sha: bytes, keys: Sequence[str], args: Sequence[str | bytes]) -> bytes:
    """EVALSHA in RESP, packed here: redis-py's generic packer costs more than the rest of
    a check (it was ~90 us of ~100 us per check in a profile)."""
    parts = [b"*%d\r\n$7\r\nEVALSHA\r\n" % (3 + len(keys) + len(args)), _bulk(sha),
             _bulk(str(len(keys)))]
    parts.extend(_bulk(k) for k in keys)
    parts.extend(_bulk(a) for a in args)
    return b"".join(parts)


def _results(ops: Sequence[Op], reply: Sequence[Any], admitted: bool) -> list[OpResult]:
    """check.lua's reply (state before the commit) -> results, as the memory store has them."""
    out: list[OpResult] = []
    for i, op in enumerate(ops):
        ok = int(reply[1 + 2 * i]) == 1
        value = float(reply[2 + 2 * i])
        commit = admitted and ok
        if isinstance(op, BucketOp):
            tokens = value - op.cost if commit else value
            retry = 0.0 if ok else (op.cost - value) / op.rate
            out.append(OpResult(ok, tokens, retry, (op.burst - tokens) / op.rate))
        else:
            count = int(value) + (1 if commit else 0)
            free = float(op.limit - count) if op.limit > 0 else math.inf
            out.append(OpResult(ok, max(0.0, free), 0.0, float(count)))
    return out


def _group_by_tag(keys: Sequence[str]) -> list[list[int]]:
    """Indexes of ``keys`` grouped by Redis Cluster hash tag, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(Keys.tag_of(key), []).append(i)
    return list(groups.values())


@dataclass(slots=True)
class StoreStats:
    """Counters for benchmarks, status and tests."""

    #: script calls sent (one EVALSHA each; NOSCRIPT retries included)
    commands: int = 0
    #: round trips: one per pipeline or single call (SCRIPT LOADs included)
    round_trips: int = 0
    script_loads: int = 0
    #: Redis Cluster: groups given back because another group refused (or failed)
    compensations: int = 0
    compensation_errors: int = 0
    #: checks abandoned by their caller (deadline) whose leases were released here
    orphans_released: int = 0
    background_errors: int = 0


@dataclass(slots=True)
class _Call:
    script: Script
    keys: Sequence[str]
    args: Sequence[str | bytes]
    future: asyncio.Future[Reply]
    #: what to do with the reply when the caller has gone (cancelled)
    orphan: Callable[[Reply], None] | None = None


# --------------------------------------------------------------------------- the store


class RedisStore:
    """The store contract on Redis, Redis Cluster or Sentinel. Build it with :meth:`from_url`."""

    def __init__(
        self,
        client: Client,
        *,
        name: str = "redis",
        now: Callable[[], float] | None = None,
        batching: bool = True,
        sentinel: Sentinel | None = None,
    ) -> None:
        self.name = name
        self.client = client
        self.batching = batching
        self.stats = StoreStats()
        self._cluster = isinstance(client, RedisCluster)
        self._now = now
        self._sentinel = sentinel
        self._scripts = {name: load_script(name) for name in SCRIPT_NAMES}
        self._pending: list[_Call] = []
        self._sender: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: see _ensure_ready
        self._ready = False
        self._init_task: asyncio.Task[None] | None = None

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        deadline: float = 0.005,
        now: Callable[[], float] | None = None,
        batching: bool | None = None,
        **kw: Any,
    ) -> RedisStore:
        """A store for ``url`` (see ``docs/redis.md``)::

            redis://[[user]:password@]host:port[/db][?ssl_...=...]        rediss:// = TLS
            redis+cluster://[[user]:password@]host:port[,host:port...]    rediss+cluster://
            redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]

        ``deadline`` is the engine's per-call deadline; socket timeouts are set to a modest
        multiple of it (the engine's ``asyncio.timeout`` is the real deadline; the socket
        timeout only bounds how long an abandoned call may hold a connection). Retries
        are off: a dead Redis fails fast. ``batching`` (default on; also the URL query
        option ``batching=false``) pipelines the checks of one event-loop iteration. ``kw``
        goes to the redis-py client.
        """
        timeout = max(0.25, 50 * deadline)
        url, from_query = _pop_query_option(url, "batching")
        if batching is None:
            batching = from_query is None or from_query.lower() not in ("0", "false", "no", "off")
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise ValueError(f"not a Redis URL: {url!r}")
        base, _, topology = scheme.lower().partition("+")
        if (base, topology) != ("unix", "") and (
            base not in ("redis", "rediss") or topology not in ("", "cluster", "sentinel")
        ):
            raise ValueError(
                f"unsupported Redis URL scheme {scheme!r}: use redis://, rediss://, "
                "redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://"
            )
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
        }
        if not topology:
            client = Redis.from_url(url, **{**options, **kw})
            return cls(client, name="redis", now=now, batching=batching)

        parts = urlsplit(f"{base}://{rest}")
        userinfo, _, hostlist = parts.netloc.rpartition("@")
        nodes = [_host_port(item) for item in hostlist.split(",") if item]
        if not nodes:
            raise ValueError(f"no host in Redis URL {url!r}")
        # redis-py's own parser for credentials, TLS and query options (one host).
        auth = f"{userinfo}@" if userinfo else ""
        single = parse_url(f"{base}://{auth}{hostlist.split(',')[0]}/?{parts.query}")
        conn: dict[str, Any] = {
            k: v for k, v in single.items() if k not in ("host", "port", "db", "connection_class")
        }
        if base == "rediss":
            conn["ssl"] = True

        if topology == "cluster":
            opts = {**options, **conn, **kw}
            cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **opts)
            return cls(cluster, name="redis-cluster", now=now, batching=batching)

        path = [unquote(p) for p in parts.path.split("/") if p]
        if not path or len(path) > 2:
            raise ValueError(f"Sentinel URL {url!r}: expected .../service_name[/db]")
        service = path[0]
        db = int(path[1]) if len(path) > 1 else 0
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
        }
        sentinel_password = conn.pop("sentinel_password", None)
        if sentinel_password:
            sentinel_kwargs["password"] = sentinel_password
        opts = {**options, **conn, **kw}
        sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_kwargs, **opts)  # type: ignore[no-untyped-call]
        client = sentinel.master_for(service, db=db)
        return cls(client, name="redis-sentinel", now=now, batching=batching, sentinel=sentinel)

    # -- sending ------------------------------------------------------------------------
    def _now_arg(self) -> str:
        return "" if self._now is None else repr(float(self._now()))

    def _submit(self, script: str, keys: Sequence[str], args: Sequence[str | bytes],
                orphan: Callable[[Reply], None] | None = None) -> asyncio.Future[Reply]:
        """Queue one script call; its future resolves to the raw reply (or a StoreError)."""
        if self._closed:
            raise StoreUnavailable("redis store is closed")
        loop = asyncio.get_running_loop()
        call = _Call(self._scripts[script], keys, args, loop.create_future(), orphan)
        if not self.batching:
            self._spawn(self._send([call]))
        else:
            self._pending.append(call)
            if self._sender is None:
                # Runs in the next loop iteration: everything submitted in this one rides along.
                self._sender = self._spawn(self._send_pending())
        return call.future

    def _spawn(self, coro: Any, *, awaited: bool = False) -> asyncio.Task[Any]:
        """A store-owned task (cancelled by :meth:`close`). Errors of tasks nobody awaits
        (orphan releases) are counted in ``stats.background_errors``."""
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._background_done if not awaited else self._awaited_done)
        return task

    def _awaited_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: its awaiters may all have been cancelled

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.stats.background_errors += 1

    async def _send_pending(self) -> None:
        batch, self._pending, self._sender = self._pending, [], None
        await self._send(batch)

    async def _ensure_ready(self) -> None:
        """Once per store, before the first command: a cluster client initialized alone
        (redis-py 8's lazy initialization races when many calls start it together), and
        every script loaded (a cold start then sends no NOSCRIPT round trips). Concurrent
        callers share one attempt; a failed attempt is retried by the next call."""
        if self._ready:
            return
        task = self._init_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._init_task = self._spawn(self._initialize(), awaited=True)
        await asyncio.shield(task)

    async def _initialize(self) -> None:
        scripts = list(self._scripts.values())
        if isinstance(self.client, RedisCluster):
            self.stats.round_trips += 1
            await self.client.initialize()
            # Best effort: with a master down the load fails there, and the healthy masters
            # must still serve (NOSCRIPT loads a script where it is missing).
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

    async def _send(self, batch: list[_Call]) -> None:
        # A check whose caller gave up before it was even sent is not sent: nothing is
        # committed for it. (Other calls, releases in particular, go out regardless.)
        batch = [call for call in batch if call.orphan is None or not call.future.cancelled()]
        if not batch:
            return
        try:
            await self._ensure_ready()
            if not isinstance(self.client, RedisCluster):
                replies: list[Any] = await self._raw_pipeline(batch)
            else:
                replies = await self._pipeline(batch)
        except asyncio.CancelledError:
            for call in batch:
                call.future.cancel()
            raise
        except BaseException as exc:  # every caller gets the error (wrapped below)
            replies = [exc] * len(batch)
        for call, reply in zip(batch, replies, strict=True):
            if call.future.cancelled():
                if call.orphan is not None and not isinstance(reply, BaseException):
                    call.orphan(reply)
            elif isinstance(reply, BaseException):
                call.future.set_exception(_wrap(reply) if isinstance(reply, _CLIENT_ERRORS) else reply)
            else:
                call.future.set_result(reply)

    def _node_of(self, key: str) -> ClusterNode | None:
        """Redis Cluster: the master serving ``key`` (None on a single Redis)."""
        if not isinstance(self.client, RedisCluster):
            return None
        try:
            return self.client.get_node_from_key(key)
        except rx.RedisClusterException:  # slot not covered: the command itself will fail
            return None

    async def _script_load(self, script: Script, node: ClusterNode | None) -> None:
        """SCRIPT LOAD where NOSCRIPT came from: on a cluster that node only, so that one
        dead master cannot keep scripts off the others."""
        self.stats.script_loads += 1
        self.stats.round_trips += 1
        if node is None:
            await self.client.script_load(script.source)
        else:
            await self.client.execute_command("SCRIPT LOAD", script.source, target_nodes=node)

    async def _raw_pipeline(self, batch: Sequence[_Call]) -> list[Any]:
        """Single Redis and Sentinel: the batch's EVALSHAs packed here and written at once on
        one pooled connection, then one reply read per call (a pipeline without redis-py's
        per-command overhead). Error replies are returned in place, like a pipeline's
        ``raise_on_error=False``; NOSCRIPT replies are loaded and resent."""
        assert isinstance(self.client, Redis)
        pool = self.client.connection_pool
        replies: list[Any] = [None] * len(batch)
        todo = list(range(len(batch)))
        for attempt in range(_NOSCRIPT_ATTEMPTS):
            data = b"".join(_pack_evalsha(batch[i].script.sha.encode(), batch[i].keys,
                                          batch[i].args) for i in todo)
            self.stats.commands += len(todo)
            self.stats.round_trips += 1
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]
            try:
                await conn.send_packed_command(data)
                for i in todo:
                    try:
                        replies[i] = await conn.read_response()
                    except rx.ResponseError as exc:  # this call's error; the stream goes on
                        replies[i] = exc
            except BaseException:
                # A half-read stream must never go back to the pool (redis-py disconnects
                # on its own errors; this covers every other way out).
                await conn.disconnect(nowait=True)
                raise
            finally:
                await pool.release(conn)
            missing = [i for i in todo if isinstance(replies[i], rx.NoScriptError)]
            if not missing or attempt + 1 == _NOSCRIPT_ATTEMPTS:
                break
            for script in {batch[i].script for i in missing}:
                await self._script_load(script, None)
            todo = missing
        return replies

    async def _evalsha(self, script: Script, keys: Sequence[str], args: Sequence[str | bytes]) -> Reply:
        for attempt in range(_NOSCRIPT_ATTEMPTS):
            self.stats.commands += 1
            self.stats.round_trips += 1
            try:
                return await self.client.evalsha(script.sha, len(keys), *keys, *args)
            except rx.NoScriptError:
                if attempt + 1 == _NOSCRIPT_ATTEMPTS:
                    raise
                await self._script_load(script, self._node_of(keys[0]))
        raise AssertionError("unreachable")

    async def _pipeline(self, batch: Sequence[_Call]) -> list[Any]:
        """Several calls in one round trip. On a cluster: one pipeline per master, sent
        concurrently, so that a dead master fails only its own calls (redis-py's
        ClusterPipeline raises for all of them when one node cannot connect, and the
        replies of the others, which did run, would be lost)."""
        if not isinstance(self.client, RedisCluster):
            return await self._pipeline_on(batch, None)
        by_node: dict[str, tuple[ClusterNode | None, list[int]]] = {}
        for i, call in enumerate(batch):
            node = self._node_of(call.keys[0])
            by_node.setdefault("" if node is None else node.name, (node, []))[1].append(i)
        parts = await asyncio.gather(
            *(self._pipeline_on([batch[i] for i in idx], node) for node, idx in by_node.values()),
            return_exceptions=True,
        )
        replies: list[Any] = [None] * len(batch)
        for (_, idx), part in zip(by_node.values(), parts, strict=True):
            for j, i in enumerate(idx):
                replies[i] = part if isinstance(part, BaseException) else part[j]
        return replies

    async def _pipeline_on(self, batch: Sequence[_Call], node: ClusterNode | None) -> list[Any]:
        """One pipeline of EVALSHAs (``transaction=False``); NOSCRIPT replies are loaded and
        resent, without a SCRIPT EXISTS round trip per pipeline."""
        if len(batch) == 1:  # a plain call costs less than a one-command ClusterPipeline
            call = batch[0]
            return [await self._evalsha(call.script, call.keys, call.args)]
        replies: list[Any] = [None] * len(batch)
        todo = list(range(len(batch)))
        for attempt in range(_NOSCRIPT_ATTEMPTS):
            pipe = self.client.pipeline(transaction=False)
            for i in todo:
                call = batch[i]
                # execute_command: redis-py's ClusterPipeline blocks the evalsha() method
                # (the slot is found from numkeys all the same; every call is one slot).
                pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys,
                                     *call.args)
            self.stats.commands += len(todo)
            self.stats.round_trips += 1
            answers = await pipe.execute(raise_on_error=False)
            missing: list[int] = []
            for i, answer in zip(todo, answers, strict=True):
                replies[i] = answer
                if isinstance(answer, rx.NoScriptError):
                    missing.append(i)
            if not missing or attempt + 1 == _NOSCRIPT_ATTEMPTS:
                break
            for script in {batch[i].script for i in missing}:
                await self._script_load(script, node)
            todo = missing
        return replies

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[str | bytes]) -> Reply:
        return await self._submit(script, keys, args)

    # -- contract -----------------------------------------------------------------------
    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        if not ops:
            return CheckResult(True, ())
        if self._cluster and len(groups := _group_by_tag([op.key for op in ops])) > 1:
            return await self._check_groups(ops, groups, lease_id)
        keys, args = self._check_args(ops, lease_id)
        reply = await self._submit("check", keys, args,
                                   orphan=lambda r: self._orphaned(ops, r, lease_id))
        admitted = int(reply[0]) == 1
        return CheckResult(admitted, tuple(_results(ops, reply, admitted)))

    def _check_args(self, ops: Sequence[Op], lease_id: str) -> tuple[list[str], list[str | bytes]]:
        args: list[str | bytes] = [self._now_arg(), lease_id]
        for op in ops:
            args.extend(_op_args(op))
        return [op.key for op in ops], args

    def _orphaned(self, ops: Sequence[Op], reply: Reply, lease_id: str) -> None:
        """A check whose caller gave up (deadline) was admitted: release its leases."""
        if int(reply[0]) != 1:
            return
        held = [op.key for i, op in enumerate(ops)
                if isinstance(op, LeaseOp) and int(reply[1 + 2 * i]) == 1]
        self._release_orphan(held, lease_id)

    def _release_orphan(self, keys: list[str], lease_id: str) -> None:
        if keys and not self._closed:
            self.stats.orphans_released += 1
            self._spawn(self.release(keys, lease_id))  # an error is counted (the TTL is the backstop)

    async def _check_groups(self, ops: Sequence[Op], groups: list[list[int]],
                            lease_id: str) -> CheckResult:
        """Redis Cluster, ops in several slots: run in a task the caller cannot cancel, so
        that a compensation always completes; an abandoned admitted check releases its leases."""
        task = self._spawn(self._check_groups_now(ops, groups, lease_id), awaited=True)
        try:
            result: CheckResult = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._groups_orphaned(t, ops, lease_id))
            raise
        return result

    def _groups_orphaned(self, task: asyncio.Task[CheckResult], ops: Sequence[Op],
                         lease_id: str) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        result = task.result()
        if result.admitted:
            held = [op.key for op, res in zip(ops, result.results, strict=True)
                    if isinstance(op, LeaseOp) and res.allowed]
            self._release_orphan(held, lease_id)

    async def _check_groups_now(self, ops: Sequence[Op], groups: list[list[int]],
                                lease_id: str) -> CheckResult:
        subsets = [[ops[i] for i in group] for group in groups]
        futures = []
        for subset in subsets:
            keys, args = self._check_args(subset, lease_id)
            futures.append(self._submit("check", keys, args))
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        failed = next((r for r in outcomes if isinstance(r, BaseException)), None)
        replies: list[Reply] = [None if isinstance(r, BaseException) else r for r in outcomes]
        admitted = failed is None and all(int(r[0]) == 1 for r in replies)
        if not admitted:
            # Give back what a group committed for a request that is not admitted.
            committed = [
                (subset, reply) for subset, reply in zip(subsets, replies, strict=True)
                if reply is not None and int(reply[0]) == 1
            ]
            if committed:
                await self._compensate(committed, lease_id)
        if failed is not None:
            raise _wrap(failed) from failed
        results: list[OpResult | None] = [None] * len(ops)
        for group, subset, reply in zip(groups, subsets, replies, strict=True):
            for i, res in zip(group, _results(subset, reply, admitted), strict=True):
                results[i] = res
        return CheckResult(admitted, tuple(r for r in results if r is not None))

    async def _compensate(self, committed: list[tuple[list[Op], Reply]], lease_id: str) -> None:
        calls = []
        for subset, reply in committed:
            keys: list[str] = []
            args: list[str | bytes] = [lease_id]
            for i, op in enumerate(subset):
                if int(reply[1 + 2 * i]) != 1:
                    continue  # refused on its own (shadow): nothing was committed
                keys.append(op.key)
                if isinstance(op, BucketOp):
                    args.extend(("b", _num(op.burst), _num(op.cost)))
                else:
                    args.extend(("l", "", ""))
            if keys:
                calls.append(self._submit("compensate", keys, args))
        self.stats.compensations += len(calls)
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                self.stats.compensation_errors += 1  # the TTLs are the backstop

    async def release(self, keys: Sequence[str], lease_id: str) -> int:
        if not keys:
            return 0
        if not self._cluster:
            return int(await self._run("release", keys, [lease_id]))
        groups = _group_by_tag(keys)
        counts = await asyncio.gather(
            *(self._run("release", [keys[i] for i in g], [lease_id]) for g in groups)
        )
        return sum(int(c) for c in counts)

    async def inflight(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        now = self._now_arg()
        if not self._cluster:
            return [int(c) for c in await self._run("inflight", keys, [now])]
        groups = _group_by_tag(keys)
        replies = await asyncio.gather(
            *(self._run("inflight", [keys[i] for i in g], [now]) for g in groups)
        )
        out = [0] * len(keys)
        for group, reply in zip(groups, replies, strict=True):
            for i, count in zip(group, reply, strict=True):
                out[i] = int(count)
        return out

    async def get_value(self, key: str) -> str | None:
        try:
            await self._ensure_ready()
            value = await self.client.get(key)
        except _CLIENT_ERRORS as exc:
            raise _wrap(exc) from exc
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
        except _CLIENT_ERRORS as exc:
            raise _wrap(exc) from exc

    async def shed_update(self, key: str, utilization: float, params: ShedParams) -> float:
        reply = await self._run("shed_update", [key], [
            self._now_arg(), _num(utilization), _num(params.good_below), _num(params.bad_above),
            _num(params.delay_before_shedding), _num(params.time_to_shed_all), _num(params.ttl),
        ])
        return float(reply)

    async def append_events(self, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
        await self._prepared()
        await redis_events.append_events(self.client, key, events, maxlen, ttl)

    async def read_events(self, key: str, since: float) -> list[str]:
        await self._prepared()
        return await redis_events.read_events(self.client, key, since)

    async def _prepared(self) -> None:
        try:
            await self._ensure_ready()
        except _CLIENT_ERRORS as exc:
            raise _wrap(exc) from exc

    async def ping(self) -> None:
        try:
            await self._ensure_ready()
            await self.client.ping()
        except _CLIENT_ERRORS as exc:
            raise _wrap(exc) from exc

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
        for call in self._pending:
            call.future.cancel()
        self._pending.clear()
        await self.client.aclose()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                await sentinel.aclose()


def _pop_query_option(url: str, name: str) -> tuple[str, str | None]:
    """``url`` without the query option ``name`` (ours, not redis-py's), and its value."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, None
    value: str | None = None
    kept = []
    for item in query.split("&"):
        key, _, val = item.partition("=")
        if key == name:
            value = val
        elif item:
            kept.append(item)
    return (f"{base}?{'&'.join(kept)}" if kept else base), value


def _host_port(item: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not port.isdigit():
        return item.strip("[]"), 6379
    return host.strip("[]"), int(port)
