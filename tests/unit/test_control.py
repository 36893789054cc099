"""The control interface (extauthz/control/control.py): StoreControl applies the admin port's rules on
the store (the embedded one here; the CLI's on Redis is in tests/integration/test_overrides.py),
AdminControl says what failed. Every failure is one ControlError (or the refusal's own
OverrideError)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extauthz.control.control import AdminControl, AdminTarget, ControlError, StoreControl
from extauthz.control.overrides import OverrideError, make_override
from extauthz.control.switches import parse_switches
from extauthz.core.clock import ManualClock
from extauthz.core.errors import StoreUnavailable
from extauthz.core.verdict import Mode
from extauthz.limiters import build_limiters
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore

from .helpers import policy_from

IDENTITY = "0123456789abcdef01234567"
POLICY: dict[str, Any] = {"limiters": [
    {"name": "user-rate", "type": "request_rate", "rate": 10, "burst": 20}]}


def control(tmp_path: Path, store: MemoryStore, clock: ManualClock, *, policy: bool = True) -> StoreControl:
    p = policy_from(tmp_path, POLICY)
    return StoreControl(store, Keys(), limiters=build_limiters(p, Keys()) if policy else None,
                        labels=p.identity_labels if policy else None, user="ana", reason="launch",
                        wall=clock.wall)


async def test_a_switch_set_on_the_store_is_stored_and_recorded(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    ctl = control(tmp_path, store, clock)
    assert await ctl.set_switch("user-rate", Mode.SHADOW) == {"switches": {"user-rate": "shadow"}}
    assert parse_switches(await store.get_value(Keys().switches)).to_dict() == {"user-rate": "shadow"}
    assert await ctl.switches() == {"switches": {"user-rate": "shadow"}}
    [change] = await ctl.history()
    assert (change.kind, change.action, change.target, change.value) == ("switch", "set", "user-rate", "shadow")
    assert (change.user, change.reason, change.via, change.at) == ("ana", "launch", "redis", 1000.0)
    with pytest.raises(ControlError, match="bad switch name"):
        await ctl.set_switch("no spaces", None)


async def test_an_override_that_would_not_apply_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    ctl = control(tmp_path, store, clock)
    new = make_override("user-rte", IDENTITY, {"rate": 5}, ttl=60, now=clock.wall())
    with pytest.raises(OverrideError, match=r"no limiter named 'user-rte' \(did you mean 'user-rate'\?\)"):
        await ctl.set_override(new)
    assert await store.get_value(Keys().overrides) is None and await ctl.history() == []
    # without a policy the store cannot tell: the override is kept and listed
    blind = control(tmp_path, store, clock, policy=False)
    rows = await blind.set_override(new)
    assert [r["limiter"] for r in rows["overrides"]] == ["user-rte"] and "applied" not in rows["overrides"][0]
    # with the policy the listing says it does not apply
    [row] = (await ctl.overrides())["overrides"]
    assert row["applied"] is False and "no limiter named 'user-rte'" in row["not_applied"]


async def test_an_override_is_set_listed_and_cleared_once(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    ctl = control(tmp_path, store, clock)
    new = make_override("user-rate", IDENTITY, {"rate": 5, "burst": 5}, ttl=60, now=clock.wall())
    rows = await ctl.set_override(new)
    assert rows["overrides"][0]["applied"] is True and rows["overrides"][0]["expires_in"] == 60.0
    assert (await ctl.clear_override("user-rate", IDENTITY)) == {"overrides": [], "max": rows["max"]}
    assert await ctl.clear_override("user-rate", IDENTITY) is None  # nothing to clear
    assert [(c.action, c.target) for c in await ctl.history()] == [
        ("set", f"user-rate {IDENTITY}"), ("clear", f"user-rate {IDENTITY}")]


async def test_a_store_error_is_a_control_error_that_names_it(tmp_path: Path) -> None:
    class Down(MemoryStore):
        async def get_value(self, key: str) -> str | None:
            raise StoreUnavailable("connection refused")

    clock = ManualClock(1000.0)
    ctl = control(tmp_path, Down(clock), clock)
    with pytest.raises(ControlError, match="StoreUnavailable: connection refused"):
        await ctl.switches()
    with pytest.raises(ControlError, match="admin port"):
        await ctl.status()  # status comes from a server
    with pytest.raises(ControlError, match="shadow log"):
        await ctl.shadow_report(60.0, 10)  # the embedded store keeps no shared shadow log


async def test_an_unreachable_admin_port_is_a_control_error(unused_tcp_port: int) -> None:
    ctl = AdminControl(AdminTarget([f"http://127.0.0.1:{unused_tcp_port}"]))
    with pytest.raises(ControlError, match="cannot reach the admin port"):
        await ctl.switches()


async def test_an_override_set_on_the_store_records_its_expiry_and_history_shows_the_lapse(tmp_path: Path) -> None:
    """``override set --redis-url``: the change log keeps the expiry, and ``history`` (the
    command's with_expiries) shows an ``expire`` row once it passed, unless cleared before."""
    from extauthz.control.changelog import with_expiries

    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    ctl = control(tmp_path, store, clock)
    other = "fedcba9876543210fedcba98"
    await ctl.set_override(make_override("user-rate", IDENTITY, {"rate": 5}, ttl=60, now=clock.wall()))
    await ctl.set_override(make_override("user-rate", other, {"rate": 5}, ttl=60, now=clock.wall()))
    clock.advance(30)
    await ctl.clear_override("user-rate", other)
    changes = await ctl.history()
    assert [c.expires_at for c in changes] == [1060.0, 1060.0, None]
    assert with_expiries(changes, now=1059.0) == changes  # not yet
    rows = [(c.action, c.target, c.at, c.via) for c in with_expiries(changes, now=2000.0)]
    assert rows == [("set", f"user-rate {IDENTITY}", 1000.0, "redis"),
                    ("set", f"user-rate {other}", 1000.0, "redis"),
                    ("clear", f"user-rate {other}", 1030.0, "redis"),
                    ("expire", f"user-rate {IDENTITY}", 1060.0, "ttl")]


async def test_a_switch_for_a_limiter_the_policy_lacks_is_refused_and_without_a_policy_stored(tmp_path: Path) -> None:
    """Issue 30: one rule on every path. With the policy the name must be one of its limiters
    (the admin port's 404, the same words); without one only its form can be checked."""
    from extauthz.control.control import UnknownLimiter

    clock = ManualClock(1000.0)
    store = MemoryStore(clock)
    ctl = control(tmp_path, store, clock)
    with pytest.raises(UnknownLimiter, match=r"^no limiter named 'user-rte' in the policy \(did you mean "
                       r"'user-rate'\?\)$") as refused:
        await ctl.set_switch("user-rte", Mode.OFF)
    assert refused.value.known == ["user-rate"]
    assert await store.get_value(Keys().switches) is None and await ctl.history() == []
    assert await ctl.set_switch("*", Mode.SHADOW) == {"switches": {"*": "shadow"}}  # names no limiter
    blind = control(tmp_path, store, clock, policy=False)
    assert await blind.set_switch("user-rte", Mode.OFF) == {"switches": {"*": "shadow", "user-rte": "off"}}
    with pytest.raises(ControlError, match="bad switch name"):
        await blind.set_switch("user rate", Mode.OFF)
