"""The table of store op kinds (issue 30): every op kind of ``base.OP_KINDS`` has its code and
ARGV order, a rule in ``store/algorithms.py``, a branch in ``lua/check.lua`` and a generator
in the differential test (``tests/store/test_differential.py``), which compares the two
executions of the rule; the memory store and the Cluster's compensation work from the rule.

Adding an op kind that misses one of these fails here, before the differential test could
pass by never sending it.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import typing

import pytest
from hypothesis import HealthCheck, Phase, find, settings

from extauthz.core.clock import ManualClock
from extauthz.store import algorithms, base
from extauthz.store.algorithms import RULES
from extauthz.store.base import OP_KINDS, Op
from extauthz.store.memory import MemoryStore
from extauthz.store.redis import cluster, wire
from tests.store.test_differential import GENERATORS

CHECK_LUA = importlib.resources.files("extauthz.lua").joinpath("check.lua").read_text()
#: the kind check.lua's release entries use (not an op kind: Store.release)
RELEASE_CODE = "r"
#: the field types the wire packs (extauthz.store.redis.wire._FORMATS)
PACKED_TYPES = {"float", "int", "str"}
#: fields an op carries for the answer, never sent to the store
LOCAL_FIELDS = {"key", "enforce", "reset"}

KIND_IDS = [kind.__name__ for kind in OP_KINDS]


def test_the_table_lists_every_member_of_op() -> None:
    assert set(OP_KINDS) == set(typing.get_args(Op))
    assert len(OP_KINDS) == len(set(OP_KINDS))


def test_every_op_kind_has_a_rule_and_every_rule_an_op_kind() -> None:
    assert set(RULES) == set(OP_KINDS)
    for kind, rule in RULES.items():
        assert rule.state in typing.get_args(algorithms.State), kind


def test_op_codes_are_one_letter_each_and_distinct() -> None:
    codes = [kind.CODE for kind in OP_KINDS]
    assert all(re.fullmatch(r"[a-z]", code) for code in codes), codes
    assert len(set(codes)) == len(codes), codes
    assert RELEASE_CODE not in codes


@pytest.mark.parametrize("kind", OP_KINDS, ids=KIND_IDS)
def test_every_op_kind_sends_each_of_its_fields_once(kind: type[Op]) -> None:
    """``ARGS`` names the op's fields (three ARGV, each a field, several joined by a space,
    or empty), of types the wire can pack, and every field the store needs is sent."""
    fields = {f.name: str(f.type) for f in dataclasses.fields(kind)}
    assert len(kind.ARGS) == 3
    sent = [name for slot in kind.ARGS for name in slot.split()]
    assert len(sent) == len(set(sent)), kind.ARGS
    assert set(sent) <= set(fields), set(sent) - set(fields)
    assert {fields[name] for name in sent} <= PACKED_TYPES
    assert set(fields) - set(sent) <= LOCAL_FIELDS, set(fields) - set(sent)


@pytest.mark.parametrize("kind", OP_KINDS, ids=KIND_IDS)
def test_every_op_kind_has_a_check_lua_branch(kind: type[Op]) -> None:
    """check.lua evaluates the kind (a branch testing ``kind == '<code>'``) and its header
    documents its code."""
    assert re.search(rf"\bkind == '{kind.CODE}'", CHECK_LUA), f"no check.lua branch for {kind.CODE!r}"
    codes_line = re.search(r"^--   ARGV\[a\] +(.+(?:\n-- {15,}.+)*)", CHECK_LUA, re.MULTILINE)
    assert codes_line is not None
    assert f'"{kind.CODE}"' in codes_line.group(1), f"check.lua's header does not list {kind.CODE!r}"


@pytest.mark.parametrize("kind", OP_KINDS, ids=KIND_IDS)
def test_every_op_kind_is_generated_by_the_differential_test(kind: type[Op]) -> None:
    """The differential test's generator for the kind makes ops of that kind, which both the
    memory store (by the table) and the wire take."""
    assert kind in GENERATORS, f"tests/store/test_differential.py has no generator for {kind.__name__}"
    ops = find(GENERATORS[kind], lambda ops: any(type(op) is kind for op in ops),
               settings=settings(max_examples=500, database=None, phases=[Phase.generate],
                                 suppress_health_check=list(HealthCheck)))
    result = MemoryStore(ManualClock(1000.0)).check_now(ops, "lease")
    assert len(result.results) == len(ops)
    keys, args = wire.check_args("", ops, "lease")
    assert keys == [op.key for op in ops]
    assert len(args) == 3 + 5 * len(ops)


def test_every_refunded_state_has_a_compensation() -> None:
    """An op whose rule refunds (Redis Cluster) refunds a state compensate.lua knows."""
    for kind, rule in RULES.items():
        if rule.refund is not None:
            assert rule.state in cluster.REFUNDS, kind


def test_the_memory_store_reads_and_writes_every_state() -> None:
    """A new state (algorithms.State) needs the memory store's reader and writer for it."""
    store = MemoryStore()
    states = set(typing.get_args(algorithms.State))
    assert set(store._read) == states
    assert set(store._write) == states


def test_give_backs_ride_and_the_grant_book_counts_what_each_op_gives_back() -> None:
    """A call of give-backs only rides with the next check (the Redis store); a renewal (a
    grant of cost 0 that brings its remainder back) takes from the store, so it does not."""
    back = base.ReturnOp("k", 1.0, 10.0, 3.5)
    quota_back = base.QuotaReturnOp("q", 2)
    renewal = base.GrantOp("k", 1.0, 10.0, 0.0, 4.0, False, 1.5)
    quota_grant = base.QuotaGrantOp("q", 100, 1, 10, 60, 30.0, True, 3)
    assert algorithms.rides([back, quota_back]) and algorithms.rides([])
    assert not algorithms.rides([back, renewal])
    assert not algorithms.rides([base.BucketOp("b", 1.0, 10.0, 1.0)])
    assert [algorithms.given_back(op) for op in (back, quota_back, renewal, quota_grant)] == [3.5, 2.0, 1.5, 3.0]
    assert algorithms.given_back(base.CountOp("c", 10, 1, 60, 30.0)) == 0.0
    assert {kind for kind, rule in RULES.items() if rule.rides} == {base.ReturnOp, base.QuotaReturnOp}
