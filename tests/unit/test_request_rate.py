"""Token bucket timelines on an injected clock (the seed gist's test, fractional refill,
cost, separate buckets). Modes and what the engine does with verdicts: tests/unit/test_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock

from .helpers import RATE, allowed_count, engine_for, get, policy_from


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














