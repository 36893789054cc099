"""The engine's grant book (extauthz/limiters/grants.py, GrantBook), built by its store gate
(extauthz/engine/storegate.py) with the store up front: nothing bound afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters import build_limiters
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore

from .helpers import get, policy_from

BATCHED = [
    {"name": "rate", "type": "request_rate", "rate": 10, "burst": 20, "consistency": "batched", "batch": 5,
     "sync_interval": "100ms"},
    {"name": "daily", "type": "quota", "limit": 100, "period": "day", "consistency": "batched",
     "sync_interval": "100ms"},
    {"name": "fleet", "type": "fleet_usage", "capacity": 50, "reserved_for_critical": 0.2,
     "consistency": "batched", "batch": 5, "sync_interval": "100ms"},
]


def test_every_grant_table_holds_the_engines_store_from_its_construction(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": BATCHED}))
    tables = [lim.grants for lim in engine.snapshot.limiters]
    assert all(t is not None and t.store is store for t in tables)  # type: ignore[attr-defined]
    assert engine.grants.store is store and engine.releaser.store is store
    # the releaser asks the book's local fleet slots first: given at construction
    assert engine.releaser.local == engine.grants.release
    assert engine.grants.holds_leases
    assert sorted(engine.grants.status()) == ["daily", "fleet", "rate"]


def test_limiters_built_without_a_store_take_no_grants_anywhere(tmp_path: Path) -> None:
    """``build_limiters`` without a store (commands that only check names): tables with no
    store never ask one; every kind declares grants and holds_leases."""
    policy = policy_from(tmp_path, {"limiters": [
        *BATCHED, {"name": "conc", "type": "concurrent_requests", "limit": 3}]})
    limiters = build_limiters(policy, Keys())
    assert [lim.holds_leases for lim in limiters] == [False, False, True, False]
    assert [lim.grants is None for lim in limiters] == [False, False, False, True]
    assert all(lim.grants is None or lim.grants.store is None for lim in limiters)  # type: ignore[attr-defined]


async def test_a_reload_adopts_the_new_limiters_and_retires_the_old_tables(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    engine = Engine(StoreGate(store, clock=clock), policy_from(tmp_path, {"limiters": BATCHED[:1]}))
    _, decision = await engine.check(get())
    assert decision.allowed
    old = engine.snapshot.limiters[0].grants
    assert old is not None and old.status()["held"] > 0
    engine.set_policy(policy_from(tmp_path, {"limiters": [{**BATCHED[0], "burst": 30}]}))
    assert old.status()["held"] == 0  # retired: what it held goes back
    assert engine.grants.limiters == engine.snapshot.limiters
    assert engine.grants.status()["rate"]["held"] == 0
    await old.drain()  # type: ignore[attr-defined]
    assert old.status()["returned"] == 4.0  # the grant of 5, less the request's 1, reached the store


async def test_a_gate_serves_one_engine(tmp_path: Path) -> None:
    """A second engine on a gate would adopt its limiters into the same grant book, which
    retires the first engine's tables under it (their grants given back while it spends
    them): refused with a clear error instead, the first engine untouched."""
    clock = ManualClock(1000.0)
    gate = StoreGate(MemoryStore(clock), clock=clock)
    policy = policy_from(tmp_path, {"limiters": BATCHED[:1]})
    engine = Engine(gate, policy)
    assert (await engine.check(get()))[1].allowed
    table = engine.snapshot.limiters[0].grants
    assert table is not None and table.status()["held"] == 4.0
    with pytest.raises(ValueError, match="StoreGate per engine"):
        Engine(gate, policy)
    assert table.status()["held"] == 4.0  # not retired
    assert engine.grants.limiters == engine.snapshot.limiters
