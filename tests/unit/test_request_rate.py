"""Token bucket timelines on an injected clock (the seed gist's test, fractional refill,
cost), modes, and what the engine does with verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.clock import ManualClock
from extauthz.switches import Switches
from extauthz.verdict import Mode, Outcome

from .helpers import engine_for, get, policy_from

RATE = {"name": "user-rate", "type": "request_rate", "rate": 100, "burst": 500}


async def allowed_count(engine, n: int, **kw) -> int:  # type: ignore[no-untyped-def]
    total = 0
    for _ in range(n):
        _, decision = await engine.check(get(**kw))
        total += decision.allowed
    return total


async def test_seed_gist_timeline(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [RATE]}), clock)
    assert await allowed_count(engine, 500) == 500
    _, d = await engine.check(get())
    assert not d.allowed and d.denied_by is not None and d.denied_by.limiter == "user-rate"
    assert d.http_status == 429
    clock.advance(1.0)
    assert await allowed_count(engine, 100) == 100
    _, d = await engine.check(get())
    assert not d.allowed


async def test_fractional_refill_and_retry_after(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [dict(RATE, rate=10, burst=2)]}), clock)
    assert await allowed_count(engine, 3) == 2
    _, d = await engine.check(get())
    assert d.denied_by is not None and d.denied_by.retry_after == pytest.approx(0.1)
    clock.advance(0.05)  # half a token: still refused
    assert await allowed_count(engine, 1) == 0
    clock.advance(0.05)
    assert await allowed_count(engine, 1) == 1
    clock.advance(0.25)  # 2.5 tokens, capped at burst 2
    assert await allowed_count(engine, 3) == 2


async def test_cost(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [dict(RATE, rate=1, burst=10, cost=4)]}), clock)
    assert await allowed_count(engine, 3) == 2  # 10 -> 6 -> 2, then refused (needs 4)
    _, d = await engine.check(get())
    assert d.denied_by is not None and d.denied_by.retry_after == pytest.approx(2.0)
    assert d.denied_by.remaining == pytest.approx(2.0)  # a refused request takes nothing


async def test_users_have_separate_buckets(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [dict(RATE, burst=3)]}), clock)
    assert await allowed_count(engine, 5, key="sk_live_a") == 3
    assert await allowed_count(engine, 5, key="sk_live_b") == 3


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
    assert store.key_count() == 0


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


def test_breaker_opens_on_failure_rate_not_on_a_few_late_answers(clock: ManualClock) -> None:
    from extauthz.breaker import Breaker

    b = Breaker(clock, threshold=5, ratio=0.5, window=1.0, open_for=1.0)
    for i in range(100):  # 10% failures on a busy host: stays closed
        assert b.allow()
        b.failure() if i % 10 == 0 else b.success()
    assert b.state == "closed"
    clock.advance(1.0)
    for _ in range(5):  # a dead store: every call fails
        assert b.allow()
        b.failure()
    assert b.state == "open" and not b.allow()
    clock.advance(1.0)
    assert b.state == "half_open" and b.allow() and not b.allow()  # one probe at a time
    b.failure()
    assert b.state == "open"
    clock.advance(1.0)
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()


async def test_an_immediate_store_error_fails_open_and_is_counted(tmp_path: Path, clock: ManualClock) -> None:
    from extauthz.errors import StoreUnavailable

    async def broken(ops, lease_id):  # type: ignore[no-untyped-def]
        raise StoreUnavailable("down")

    engine, _ = engine_for(policy_from(tmp_path, {"limiters": [RATE]}), clock, store_check=broken)
    _, d = await engine.check(get())
    assert d.allowed and d.verdicts[0].outcome is Outcome.FAILED_OPEN and d.failures == ("unavailable",)
    assert engine.failures == {"unavailable": 1}
