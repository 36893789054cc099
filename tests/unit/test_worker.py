"""The worker utilization shedder: the seed gist's controller on an injected clock, the
tier mapping, and the drill policy from the issue."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest
from extauthz.core.tiers import Tier
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters.worker import WorkerUtilizationShedder, sample_once
from extauthz.store import algorithms
from extauthz.store.base import ShedParams
from extauthz.store.memory import MemoryStore
from testinfra.probes import release_and_wait

from .helpers import policy_from

WORKERS = {"name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
           "good_below": 0.7, "bad_above": 0.8, "delay_before_shedding": "28s", "time_to_shed_all": "120s"}
RESTING = -28 / 120
TIER_REQUESTS = {
    Tier.TEST: RawRequest("GET", "/v1/x", headers={"x-api-key": "sk_test_1"}),
    Tier.GET: RawRequest("GET", "/v1/x", headers={"x-api-key": "sk_live_1"}),
    Tier.POST: RawRequest("POST", "/v1/x", headers={"x-api-key": "sk_live_1"}),
    Tier.CRITICAL: RawRequest("POST", "/v1/x", route_tier="critical", headers={"x-api-key": "sk_live_1"}),
}


class Drill:
    """An engine with one worker shedder whose signal the test sets."""

    def __init__(self, tmp_path: Path, clock: ManualClock, seed: int = 0, **overrides: object) -> None:
        self.clock = clock
        self.store = MemoryStore(clock)
        policy = policy_from(tmp_path, {"limiters": [dict(WORKERS, **overrides)],
                                        "test_mode": {"key_prefix": "sk_test_"}})
        self.engine = Engine(StoreGate(self.store, clock=clock), policy, rng=random.Random(seed))

    @property
    def shedder(self) -> WorkerUtilizationShedder:
        return self.engine.snapshot.workers[0]

    async def sample(self, utilization: float) -> float:
        await self.store.set_value(self.shedder.signal_key, repr(utilization))
        level = await sample_once(self.engine, self.shedder)
        assert level is not None
        return level

    async def dropped(self, tier: Tier) -> bool:
        _, decision = await self.engine.check(TIER_REQUESTS[tier])
        if not decision.allowed:
            assert decision.http_status == 503 and decision.denied_by is not None
            assert decision.denied_by.reason == f"shedding_{tier.value}"
        return not decision.allowed


def test_resting_amount_is_float_division() -> None:
    p = ShedParams(0.7, 0.8, 28, 120, 300)
    assert p.resting == pytest.approx(-0.23333, abs=1e-5)  # the gist's Ruby integer division gives -1


async def test_utilization_zero_sheds_nothing(tmp_path: Path, clock: ManualClock) -> None:
    drill = Drill(tmp_path, clock)
    for _ in range(1001):
        clock.advance(1)
        assert await drill.sample(0.0) == pytest.approx(RESTING)
        for tier in Tier:
            assert not await drill.dropped(tier)


async def run_ramp(drill: Drill, clock: ManualClock) -> tuple[list[float], int]:
    """The gist's case: rest, then utilization 1 at ticks t = 0..148 s with one request
    per non-critical tier each tick. Returns the level at each tick and the drops."""
    for _ in range(3):
        clock.advance(1)
        await drill.sample(0.0)
    levels, drops = [], 0
    for t in range(149):
        if t:
            clock.advance(1)
        levels.append(await drill.sample(1.0))
        for tier in (Tier.TEST, Tier.GET, Tier.POST):
            drops += await drill.dropped(tier)
        assert not await drill.dropped(Tier.CRITICAL)
    return levels, drops


async def test_seed_gist_ramp_levels_and_next_call_is_shed(tmp_path: Path, clock: ManualClock) -> None:
    drill = Drill(tmp_path, clock)
    levels, _ = await run_ramp(drill, clock)
    for t, level in enumerate(levels):
        assert level == pytest.approx(RESTING + t / 120), t
    assert levels[28] == pytest.approx(0.0) and levels[27] < 0 < levels[29]
    assert levels[148] == pytest.approx(1.0)
    clock.advance(1)
    await drill.sample(1.0)
    for tier in (Tier.TEST, Tier.GET, Tier.POST):
        assert await drill.dropped(tier)
    assert not await drill.dropped(Tier.CRITICAL)


async def test_seed_gist_expected_drops_statistically(tmp_path: Path) -> None:
    """Expected drops over the ramp: sum over t of max(0, (t - 28) / 120) = 60.5 per
    tier on average (the tier mapping keeps the mean drop chance equal to the level)."""
    runs = 60
    per_tier = []
    for seed in range(runs):
        clock = ManualClock()
        drill = Drill(tmp_path, clock, seed=seed)
        _, drops = await run_ramp(drill, clock)
        per_tier.append(drops / 3)
    mean = sum(per_tier) / runs
    assert mean == pytest.approx(60.5, abs=1.2)  # ~4 standard errors


async def test_dead_zone_holds_the_level(tmp_path: Path, clock: ManualClock) -> None:
    drill = Drill(tmp_path, clock)
    for _ in range(60):
        clock.advance(1)
        await drill.sample(1.0)
    held = drill.shedder.level
    for u in (0.7, 0.75, 0.7999):
        for _ in range(30):
            clock.advance(1)
            assert await drill.sample(u) == pytest.approx(held)


async def test_recovery_takes_as_long_as_the_ramp(tmp_path: Path, clock: ManualClock) -> None:
    drill = Drill(tmp_path, clock)
    await drill.sample(0.0)  # the first sample starts the controller at rest
    ramp_up = 0
    while drill.shedder.level < 1.0 - 1e-9:
        clock.advance(1)
        await drill.sample(1.0)
        ramp_up += 1
    ramp_down = 0
    while drill.shedder.level > RESTING + 1e-9:
        clock.advance(1)
        await drill.sample(0.0)
        ramp_down += 1
    assert ramp_up == ramp_down == 148
    # half-way utilization below good recovers at half speed
    p = drill.shedder.params
    assert algorithms.shed_derivative(0.35, p) == pytest.approx(-0.5 / 120)


async def test_tier_order_at_every_tick_up_and_down(tmp_path: Path, clock: ManualClock) -> None:
    drill = Drill(tmp_path, clock)
    seen_partial = set()
    for u in [1.0] * 150 + [0.0] * 150:
        clock.advance(1)
        await drill.sample(u)
        p = drill.shedder.probabilities
        assert p[Tier.TEST] >= p[Tier.GET] >= p[Tier.POST] >= p[Tier.CRITICAL] == 0.0
        for tier in (Tier.TEST, Tier.GET, Tier.POST):
            if 0 < p[tier] < 1:
                seen_partial.add(tier)
        assert not await drill.dropped(Tier.CRITICAL)
    assert seen_partial == {Tier.TEST, Tier.GET, Tier.POST}


async def test_elapsed_time_is_clamped(tmp_path: Path, clock: ManualClock) -> None:
    drill = Drill(tmp_path, clock)
    clock.advance(1)
    await drill.sample(1.0)
    clock.advance(1000)  # a long pause between samples moves the level by at most 28 s
    assert await drill.sample(1.0) == pytest.approx(RESTING + 28 / 120)


def test_drill_policy_from_the_issue_is_accepted(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, {"limiters": [{
        "name": "workers", "type": "worker_utilization", "signal": {"source": "inflight", "capacity": 4},
        "sample_interval": "0.2s", "good_below": 0.7, "bad_above": 0.8,
        "delay_before_shedding": "1s", "time_to_shed_all": "3s"}]})
    spec = policy.limiters[0]
    assert spec.sample_interval == 0.2 and spec.time_to_shed_all == 3.0  # type: ignore[union-attr]


async def test_inflight_signal_counts_leases(tmp_path: Path, clock: ManualClock) -> None:
    drill = Drill(tmp_path, clock, signal={"source": "inflight", "capacity": 4},
                  delay_before_shedding="1s", time_to_shed_all="3s")
    decisions = [(await drill.engine.check(TIER_REQUESTS[Tier.GET]))[1] for _ in range(4)]
    assert all(len(d.leases) == 1 for d in decisions)  # count-only leases of its own
    from extauthz.limiters.worker import read_utilization

    assert await read_utilization(drill.engine, drill.shedder) == 1.0
    await release_and_wait(drill.engine.releaser, decisions[0].leases, decisions[0].lease_id, "access_log")
    assert await read_utilization(drill.engine, drill.shedder) == 0.75
