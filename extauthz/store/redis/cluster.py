"""Redis Cluster: ops grouped by hash tag (per-user keys ``{u:<hash>}``, fleet keys
``{fleet}``), the groups evaluated concurrently, and when one group committed while another
refused (or failed), ``compensate.lua`` gives the commit back before the check returns.
Pipelines go one per master, so that a dead master fails only its own calls."""

from __future__ import annotations

import asyncio
import functools
import operator
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Final

from redis import exceptions as rx
from redis.asyncio.cluster import ClusterNode, RedisCluster

from ...core.errors import StoreError
from .. import algorithms
from ..base import CheckResult, Op, OpResult
from ..keys import Keys
from .wire import UNKNOWN, Merge, Reply, StoreStats, Unanswered, check_results, num, unknown_reply, wrap

__all__ = ["REFUNDS", "check_groups", "group_by_tag", "node_of", "pipeline_by_node"]

#: submit(script name, keys, args) -> the reply's future
Submit = Callable[[str, Sequence[str], Sequence[str | bytes]], Awaitable[Reply]]
#: settled(late, key, then): ``then(late answer)`` once it came and the key's master answers again
Settled = Callable[[Any, str, Callable[[Reply], Any]], Any]
#: the ARGV of one check.lua call for ``ops``
CheckArgs = Callable[[Sequence[Op], str], tuple[list[str], list[str | bytes]]]


def group_by_tag(keys: Sequence[str]) -> list[list[int]]:
    """Indexes of ``keys`` grouped by Redis Cluster hash tag, in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(Keys.tag_of(key), []).append(i)
    return list(groups.values())


def node_of(client: Any, key: str) -> ClusterNode | None:
    """Redis Cluster: the master serving ``key`` (None on a single Redis)."""
    if not isinstance(client, RedisCluster):
        return None
    try:
        return client.get_node_from_key(key)
    except rx.RedisClusterException:  # slot not covered: the command itself will fail
        return None


async def pipeline_by_node(
    client: RedisCluster, keys: Sequence[Sequence[str]],
    pipeline_on: Callable[[list[int], ClusterNode | None], Awaitable[list[Any]]],
) -> list[Any]:
    """Calls (given by their keys) in one pipeline per master, sent concurrently, so that
    a dead master fails only its own calls (redis-py's ClusterPipeline raises for all of
    them when one node cannot connect, and the replies of the others, which did run, would
    be lost). ``pipeline_on(indexes, node)`` sends one node's calls."""
    by_node: dict[str, tuple[ClusterNode | None, list[int]]] = {}
    for i, call_keys in enumerate(keys):
        node = node_of(client, call_keys[0])
        by_node.setdefault("" if node is None else node.name, (node, []))[1].append(i)
    parts = await asyncio.gather(
        *(pipeline_on(idx, node) for node, idx in by_node.values()), return_exceptions=True,
    )
    replies: list[Any] = [None] * len(keys)
    for (_, idx), part in zip(by_node.values(), parts, strict=True):
        for j, i in enumerate(idx):
            replies[i] = (part.part(operator.itemgetter(j)) if isinstance(part, Unanswered)
                          else part if isinstance(part, BaseException) else part[j])
    return replies


async def check_groups(submit: Submit, check_args: CheckArgs, stats: StoreStats,
                       ops: Sequence[Op], groups: list[list[int]], lease_id: str,
                       settled: Settled) -> CheckResult:
    """One check.lua call per hash tag group; a group that committed for a request that is
    not admitted is given back (compensated) before this returns, and a group sent but not
    answered in time (``late``) is given back if its answer comes committed after all
    (``settled``: once it came and its master answers again)."""
    subsets = [[ops[i] for i in group] for group in groups]
    futures = []
    for subset in subsets:
        keys, args = check_args(subset, lease_id)
        futures.append(submit("check", keys, args))
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    for subset, outcome in zip(subsets, outcomes, strict=True):
        if isinstance(outcome, StoreError) and outcome.late is not None:
            settled(outcome.late, subset[0].key, functools.partial(
                _late_group, submit, stats, subset, lease_id))
            outcome.late = None  # handled here: the request is refused, nothing else acts on it
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
            await _compensate(submit, stats, committed, lease_id)
    if failed is not None:
        error = wrap(failed)
        error.keys = tuple(subset[0].key for subset, outcome in zip(subsets, outcomes, strict=True)
                           if isinstance(outcome, BaseException))
        raise error from failed
    results: list[OpResult | None] = [None] * len(ops)
    for group, subset, reply in zip(groups, subsets, replies, strict=True):
        for i, res in zip(group, check_results(subset, reply, admitted), strict=True):
            results[i] = res
    return CheckResult(admitted, tuple(r for r in results if r is not None))


def _late_group(submit: Submit, stats: StoreStats, subset: list[Op], lease_id: str,
                reply: Reply) -> Coroutine[Any, Any, None] | None:
    """The late answer of a group of a refused request: given back if it committed (its
    leases, when the answer is :data:`.wire.UNKNOWN`: the call may have run)."""
    if reply is UNKNOWN:
        reply = unknown_reply(subset)
    if isinstance(reply, BaseException) or Merge.failure(reply) is not None or int(reply[0]) != 1:
        return None
    return _compensate(submit, stats, [(subset, reply)], lease_id)


#: compensate.lua's entry for a refund of each state (see its header): its kind and two ARGV,
#: from the op and its rule's ``refund`` amount (a state absent here is never refunded)
REFUNDS: Final[dict[str, Callable[[Any, float], tuple[str, str, str]]]] = {
    algorithms.TOKENS: lambda op, amount: ("b", num(op.burst), num(amount)),
    algorithms.COUNT: lambda op, amount: ("q", str(int(amount)), ""),
    algorithms.LEASES: lambda op, amount: ("l", "", ""),
}


async def _compensate(submit: Submit, stats: StoreStats,
                      committed: list[tuple[list[Op], Reply]], lease_id: str) -> None:
    """Give back, per group, what its committed ops took: each op's rule says how much
    (``Rule.refund``, from the state it read: what check.lua returned)."""
    calls = []
    for subset, reply in committed:
        keys: list[str] = []
        args: list[str | bytes] = [lease_id]
        for i, op in enumerate(subset):
            rule = algorithms.RULES[type(op)]
            if int(reply[1 + 2 * i]) != 1 or rule.refund is None:
                # refused on its own (shadow): nothing was committed; nothing to refund
                # (a fleet grant's slots stay taken until their life, grant TTL +
                # lease_ttl, FleetSlots.life: only early refusals)
                continue
            keys.append(op.key)
            args.extend(REFUNDS[rule.state](op, rule.refund(op, float(reply[2 + 2 * i]))))
        if keys:
            calls.append(submit("compensate", keys, args))
    stats.compensations += len(calls)
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, BaseException):
            stats.compensation_errors += 1  # the TTLs are the backstop
