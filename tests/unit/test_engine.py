"""The engine (extauthz/engine/engine.py) on the embedded store and an injected clock: modes (shadow,
off, switched at runtime), a limiter's scope, no partial commit across limiters, fail-open on a
store error."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.control.switches import Switches
from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Mode, Outcome
from testinfra.probes import key_count

from .helpers import RATE, allowed_count, engine_for, get, policy_from


async def test_shadow_mode_records_would_deny_and_allows(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [dict(RATE, burst=2, mode="shadow")]}), clock)
    outcomes = []
    for _ in range(4):
        _, d = await engine.check(get())
        assert d.allowed
        outcomes.append(d.verdicts[0].outcome)
    assert outcomes == [Outcome.ALLOWED, Outcome.ALLOWED, Outcome.SHADOW_DENIED, Outcome.SHADOW_DENIED]


async def test_off_mode_skips_the_limiter(tmp_path: Path, clock: ManualClock) -> None:
    engine, store = engine_for(policy_from(tmp_path, {"limiters": [dict(RATE, burst=1, mode="off")]}), clock)
    for _ in range(3):
        _, d = await engine.check(get())
        assert d.allowed and d.verdicts == ()
    assert key_count(store) == 0


async def test_switches_override_policy_mode(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [dict(RATE, burst=1)]}), clock)
    assert await allowed_count(engine, 3) == 1
    engine.set_switches(Switches(limiters={"user-rate": Mode.SHADOW}))
    assert await allowed_count(engine, 3) == 3
    engine.set_switches(Switches(global_mode=Mode.OFF, limiters={"user-rate": Mode.ENFORCE}))
    _, d = await engine.check(get())
    assert d.allowed and d.verdicts == ()
    engine.set_switches(Switches())
    assert await allowed_count(engine, 1) == 0


async def test_applies_to_scopes_a_limiter(tmp_path: Path, clock: ManualClock) -> None:
    limiter = dict(RATE, burst=1, applies_to={"tiers": ["get"], "path_prefix": "/v1/reports"})
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [limiter]}), clock)
    assert await allowed_count(engine, 3, path="/v1/reports/x") == 1
    assert await allowed_count(engine, 3, path="/v1/customers") == 3
    assert await allowed_count(engine, 3, path="/v1/reports/x", method="POST") == 3


async def test_no_partial_commit_between_two_buckets(tmp_path: Path, clock: ManualClock) -> None:
    engine, store = engine_for(policy_from(tmp_path, {"limiters": [
        dict(RATE, name="wide", burst=100), dict(RATE, name="narrow", burst=1)]}), clock)
    assert await allowed_count(engine, 5) == 1
    ctx = engine.context(get())
    assert store.tokens(engine.keys.bucket("wide", ctx.identity)) == pytest.approx(99)


async def test_an_immediate_store_error_fails_open_and_is_counted(tmp_path: Path, clock: ManualClock) -> None:
    from extauthz.core.errors import StoreUnavailable

    async def broken(ops, lease_id):  # type: ignore[no-untyped-def]
        raise StoreUnavailable("down")

    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [RATE]}), clock, store_check=broken)
    _, d = await engine.check(get())
    assert d.allowed and d.verdicts[0].outcome is Outcome.FAILED_OPEN and d.failures == ("unavailable",)
    assert engine.failures == {"unavailable": 1}

