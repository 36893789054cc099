"""The script cache (extauthz/store/redis/wire.py): SCRIPT FLUSH mid-run, the one NOSCRIPT path.
"""

from __future__ import annotations

import asyncio

import pytest

from extauthz.store.base import (
    OP_KINDS,
    BucketOp,
    CountOp,
    FleetGrantOp,
    GrantOp,
    LeaseOp,
    Op,
    QuotaGrantOp,
    QuotaReturnOp,
    ReturnOp,
    SliceOp,
)
from extauthz.store.redis.wire import UNKNOWN, check_args, check_result, op_args
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



def test_each_op_kind_packs_as_check_lua_reads_it() -> None:
    """The 5 ARGV per op (check.lua's header), packed from each kind's ``CODE`` and ``ARGS``:
    floats as ``repr(float)``, ints as integers, several fields joined by a space."""
    expected: dict[Op, tuple[bytes, ...]] = {
        BucketOp("k", 7, 2.3, 0.7): (b"b", b"1", b"7.0", b"2.3", b"0.7"),
        LeaseOp("k", 5, 10 / 7, enforce=False): (b"l", b"0", b"5", b"1.4285714285714286", b""),
        CountOp("k", 3, 2, 3600, 12.5): (b"q", b"1", b"3", b"2", b"3600"),
        GrantOp("k", 100 / 3, 5, 1, 9, True, 1 / 7):
            (b"g", b"1", b"33.333333333333336", b"5.0", b"1.0 9.0 0.14285714285714285"),
        ReturnOp("k", 0.7, 1.7, 0.3): (b"u", b"0", b"0.7", b"1.7", b"0.3"),
        QuotaGrantOp("k", 6, 1, 4, 60, 1.5, False, 2): (b"c", b"0", b"6", b"1 4 2", b"60"),
        QuotaReturnOp("k", 3): (b"v", b"0", b"3", b"", b""),
        FleetGrantOp("k", 7, 0.3, "g1", 3, -2, True, 1): (b"f", b"1", b"7", b"0.3", b"g1 3 -2 1"),
        SliceOp("k", 10, 15.5, "r1.7", 3): (b"s", b"0", b"10", b"15.5", b"r1.7 3"),
    }
    assert {type(op) for op in expected} == set(OP_KINDS)
    for op, args in expected.items():
        assert op_args(op) == args, op
    keys, argv = check_args("", list(expected), "lease-1")
    assert keys == ["k"] * len(expected)
    assert argv == ["", "lease-1", str(len(expected)), *(a for args in expected.values() for a in args)]


def test_an_unanswered_call_is_taken_as_committed_only_for_its_leases() -> None:
    """wire.UNKNOWN (the call may have run): every lease op held (its release is harmless),
    nothing else committed: no tokens, quota units or fleet slots refunded on a guess."""
    ops: list[Op] = [BucketOp("b", 1, 2, 1), LeaseOp("l", 2, 30), CountOp("c", 3, 1, 60, 60.0),
                     GrantOp("g", 1, 2, 1, 2), QuotaGrantOp("q", 3, 1, 2, 60, 60.0),
                     FleetGrantOp("f", 3, 1.0, "g", 0, 1)]
    result = check_result(ops, UNKNOWN)
    assert result.admitted
    assert [res.allowed for res in result.results] == [isinstance(op, LeaseOp) for op in ops]
