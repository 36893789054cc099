"""Overload (extauthz/engine/overload.py, Engine.decide's time left): the loop's lag on an injected
clock, and what the engine decides for a starved server or a check with no time left."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Outcome
from extauthz.engine.engine import Engine
from extauthz.engine.overload import LoopLag
from extauthz.engine.storegate import StoreGate
from extauthz.store.memory import MemoryStore

from ..observe.helpers import eventually
from .helpers import RATE, FaultyStore, engine_for, get, policy_from

CRITICAL = {"method": "POST", "path": "/v1/charges"}
FLEET = {"name": "fleet", "type": "fleet_usage", "capacity": 10, "reserved_for_critical": 0.2}
WORKERS = {"name": "workers", "type": "worker_utilization", "signal": {"source": "redis"},
           "good_below": 0.7, "bad_above": 0.8, "delay_before_shedding": "1s", "time_to_shed_all": "1s"}
RULES = {"classification": {"rules": [{"match": {"methods": ["POST"], "path_prefix": "/v1/charges"},
                                       "tier": "critical"}]}}


# -- the loop's lag ----------------------------------------------------------------------


def test_lag_is_how_late_the_sampler_woke() -> None:
    clock = ManualClock()
    lag = LoopLag(0.2, clock=clock, interval=0.025)
    assert lag.threshold == pytest.approx(0.1)
    assert lag.lag() == 0.0 and not lag.starved()  # no sample yet: nothing known
    lag.tick()
    clock.advance(0.025)
    lag.tick()  # on time
    assert lag.lag() == 0.0
    clock.advance(0.025 + 0.12)
    lag.tick()  # 120 ms late: starved
    assert lag.last == pytest.approx(0.12) and lag.starved()
    clock.advance(0.025)
    lag.tick()  # on time again: still starved for as long as the late sample's lag
    assert lag.lag() == 0.0 and lag.starved()
    for _ in range(3):
        clock.advance(0.025)
        lag.tick()
    assert lag.starved()  # 100 ms after it
    clock.advance(0.025)
    lag.tick()  # 125 ms after it
    assert not lag.starved() and lag.peak == pytest.approx(0.12)
    clock.advance(0.025 + 5.0)
    lag.tick()  # a 5 s stall: starved for one budget after it (at most)
    for _ in range(7):
        clock.advance(0.025)
        lag.tick()
    assert lag.lag() == 0.0 and lag.starved()  # 175 ms after it
    clock.advance(0.05)
    lag.tick()  # 225 ms after it
    assert not lag.starved()


def test_an_overdue_sampler_is_a_stall_in_progress() -> None:
    """Checks queued behind a stall run before the sampler does: they see the stall from the
    time since the sampler last ran."""
    clock = ManualClock()
    lag = LoopLag(0.2, clock=clock, interval=0.025)
    lag.tick()
    clock.advance(0.025 + 0.099)
    assert not lag.starved()
    clock.advance(0.002)
    assert lag.lag() == pytest.approx(0.101) and lag.starved()


def test_a_stopped_sampler_reads_as_no_lag() -> None:
    clock = ManualClock()
    running = [True]
    lag = LoopLag(0.2, clock=clock, running=lambda: running[0])
    lag.tick()
    clock.advance(5.0)
    assert lag.starved()
    running[0] = False  # a graceful stop: the runner's jobs are cancelled
    assert lag.lag() == 0.0 and not lag.starved()


def test_time_left_is_the_budget_less_the_wait_and_never_past_the_call_deadline() -> None:
    lag = LoopLag(0.2, clock=ManualClock())
    assert lag.left() == pytest.approx(0.2)
    assert lag.left(None, 0.15) == pytest.approx(0.05)
    assert lag.left(0.3, 0.0) == pytest.approx(0.2)  # Envoy's rendered timeout: the budget
    assert lag.left(0.5, 0.25) == pytest.approx(-0.05)
    # Envoy's margin (50 ms) is at most a quarter of a short deadline: a client's 30 ms call
    # has 22.5 ms, not none
    assert lag.left(0.12, 0.0) == pytest.approx(0.09)
    assert lag.left(0.24, 0.0) == pytest.approx(0.19)
    assert lag.left(0.03, 0.0) == pytest.approx(0.0225)
    assert lag.left(-0.01, 0.0) == pytest.approx(-0.01)


def test_a_short_deadline_on_a_healthy_loop_is_not_starved_and_is_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    lag = LoopLag(0.2, clock=clock, interval=0.025)
    lag.tick()
    clock.advance(0.025)
    lag.tick()
    with caplog.at_level("WARNING", logger="extauthz.overload"):
        for remaining in (0.03, 0.001, -0.005):
            assert lag.check(remaining, 0.0)[1] is False
        assert lag.check(0.25, 0.0) == (pytest.approx(0.2), False)
    warned = [r for r in caplog.records if "less than the check budget" in r.getMessage()]
    assert len(warned) == 1, caplog.records  # throttled: once, not per check
    assert lag.check(None, 0.2)[1]  # HTTP: a check that waited its whole budget is starved


def test_on_grpc_only_a_stall_the_process_did_not_run_through_starves() -> None:
    """gRPC's threads stamp a call's deadline on arrival while the loop stalls (a garbage
    collection holds it, the process runs): the deadline saw that stall. A stop (SIGSTOP,
    the CPU taken) stamps nothing: the lag alone tells it. HTTP has no deadline: any stall."""
    clock, cpu = ManualClock(), [0.0]
    lag = LoopLag(0.2, clock=clock, interval=0.025, cpu=lambda: cpu[0])
    lag.tick()
    # a 150 ms collection: the loop stalled, the process ran
    clock.advance(0.025 + 0.15)
    cpu[0] += 0.16
    assert lag.check(None, 0.0)[1]  # HTTP: starved (overdue sampler)
    assert not lag.check(0.25, 0.0)[1]  # gRPC: the deadline saw it
    lag.tick()
    assert lag.check(None, 0.0)[1] and not lag.check(0.25, 0.0)[1]
    clock.advance(0.025)
    cpu[0] += 0.001
    lag.tick()
    # a 150 ms stop: no CPU time
    clock.advance(0.025 + 0.15)
    assert lag.check(None, 0.0)[1] and lag.check(0.25, 0.0)[1]  # overdue: both
    lag.tick()
    assert lag.unseen == pytest.approx(0.15)
    for _ in range(5):  # starved for as long again as the stop, on both doors
        clock.advance(0.025)
        lag.tick()
        assert lag.check(None, 0.0)[1] and lag.check(0.25, 0.0)[1]
    clock.advance(0.05)
    lag.tick()
    assert not lag.check(None, 0.0)[1] and not lag.check(0.25, 0.0)[1]


def test_a_deadline_stamped_when_the_loop_read_the_call_saw_no_stall() -> None:
    """The gRPC port on the event loop stamps a call's deadline when the loop reads it, after
    any stall of the loop: starved by the HTTP rule, while the deadline still bounds the
    time left."""
    clock, cpu = ManualClock(), [0.0]
    lag = LoopLag(0.2, clock=clock, interval=0.025, cpu=lambda: cpu[0])
    lag.tick()
    clock.advance(0.025 + 0.15)  # a 150 ms collection: the loop stalled, the process ran
    cpu[0] += 0.16
    assert not lag.check(0.25, 0.0)[1]  # stamped on arrival: the deadline saw it
    left, starved = lag.check(0.25, 0.0, on_arrival=False)
    assert starved and left == lag.check(0.25, 0.0)[0]
    lag.tick()
    for _ in range(5):  # after it, for as long again as the stall (as on the HTTP port)
        clock.advance(0.025)
        lag.tick()
        assert lag.check(0.25, 0.0, on_arrival=False)[1] == lag.check(None, 0.0)[1]
    for _ in range(8):  # the loop on time again
        clock.advance(0.025)
        lag.tick()
    assert not lag.check(0.25, 0.0, on_arrival=False)[1]
    assert lag.check(0.1, 0.0, on_arrival=False)[0] < lag.check(None, 0.0)[0]  # the deadline bounds it


# -- what the engine decides ---------------------------------------------------------------


async def test_starved_shedders_refuse_non_critical_at_once_and_never_critical(
        tmp_path: Path, clock: ManualClock) -> None:
    engine, store = engine_for(policy_from(tmp_path, {**RULES, "limiters": [FLEET, WORKERS]}), clock)
    ctx = engine.context(get())
    d = await engine.decide(ctx, 0.2, starved=True)
    assert not d.allowed and d.denied_by is not None
    assert d.denied_by.reason == "overload" and d.denied_by.limiter == "fleet"
    assert d.leases == ()  # refused without the store: no lease taken
    assert await store.inflight([engine.snapshot.limiters[0].other_key]) == [0]  # type: ignore[attr-defined]
    crit = engine.context(get(**CRITICAL))
    d = await engine.decide(crit, 0.2, starved=True)
    assert d.allowed and len(d.leases) == 1  # critical: as usual, with its lease
    assert engine.failures == {}
    # not starved: the same non-critical request is admitted
    d = await engine.decide(engine.context(get()), 0.2, starved=False)
    assert d.allowed


async def test_the_worker_shedder_refuses_when_starved(tmp_path: Path, clock: ManualClock) -> None:
    engine, _ = engine_for(policy_from(tmp_path, {**RULES, "limiters": [WORKERS]}), clock)
    d = await engine.decide(engine.context(get()), 0.2, starved=True)
    assert not d.allowed and d.denied_by is not None
    assert (d.denied_by.limiter, d.denied_by.reason) == ("workers", "overload")
    assert (await engine.decide(engine.context(get(**CRITICAL)), 0.2, starved=True)).allowed


async def test_a_shadow_shedder_goes_on_as_usual_and_keeps_counting(tmp_path: Path, clock: ManualClock) -> None:
    """A shadow shedder refuses nothing: starved, it takes its lease as usual (the fleet's
    in-flight count stays whole)."""
    engine, _ = engine_for(policy_from(tmp_path, {**RULES, "limiters": [dict(FLEET, mode="shadow")]}), clock)
    d = await engine.decide(engine.context(get()), 0.2, starved=True)
    assert d.allowed and d.verdicts[0].outcome is Outcome.ALLOWED and len(d.leases) == 1


async def test_no_time_left_fails_store_limiters_per_failure_mode_counted_overload(
        tmp_path: Path, clock: ManualClock) -> None:
    """A store that waits (Redis) is not called with no time left; the embedded store answers
    within the call: decided as usual. A short deadline alone sheds nothing (not starved)."""
    policy = policy_from(tmp_path, {**RULES, "limiters": [
        RATE, dict(RATE, name="strict", failure_mode="closed"), FLEET]})
    engine = Engine(StoreGate(FaultyStore(MemoryStore(clock)), clock=clock), policy)
    d = await engine.decide(engine.context(get(**CRITICAL)), 0.0)
    outcomes = {v.limiter: (v.outcome, v.reason) for v in d.verdicts}
    assert outcomes["user-rate"] == (Outcome.FAILED_OPEN, "store_overload")
    assert outcomes["strict"] == (Outcome.FAILED_CLOSED, "store_overload")
    assert not d.allowed and d.failures == ("overload",)
    assert engine.failures == {"overload": 1}
    # a non-critical request with no time left, the server not starved: not shed
    d = await engine.decide(engine.context(get()), -0.01)
    assert d.denied_by is not None and d.denied_by.reason == "store_overload"
    # the embedded store: decided as usual, whatever the time left
    embedded, _ = engine_for(policy, clock)
    for left in (0.0, -0.01):
        d = await embedded.decide(embedded.context(get()), left)
        assert d.allowed and d.failures == () and len(d.leases) == 1, d
    assert embedded.failures == {}


class _LateStore(FaultyStore):
    """The embedded store behind a call that answers when told to (a store slower than a
    check's time left), through the event loop as Redis does."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.go = asyncio.Event()
        self.answered = 0

    async def check(self, ops: Any, lease_id: str) -> Any:
        await self.go.wait()
        self.answered += 1
        return await self.inner.check(ops, lease_id)


async def test_the_store_call_never_outlives_the_time_left(tmp_path: Path, clock: ManualClock) -> None:
    policy = policy_from(tmp_path, {**RULES, "limiters": [
        {"name": "conc", "type": "concurrent_requests", "limit": 5, "lease_ttl": "60s"}]})
    store = _LateStore(MemoryStore(clock))
    # a store deadline far longer than the check's time left: the time left decides
    engine = Engine(StoreGate(store, clock=clock, deadline=30.0), policy)
    d = await asyncio.wait_for(engine.decide(engine.context(get()), 0.05), 10.0)
    assert d.allowed and d.failures == ("overload",) and d.leases == ()
    assert d.verdicts[0].outcome is Outcome.FAILED_OPEN and d.verdicts[0].reason == "store_overload"
    assert engine.failures == {"overload": 1} and engine.gate.breaker.state == "closed"
    # the call went on: when it lands, the lease it took goes back (nothing leaks)
    store.go.set()
    await eventually(lambda: store.releases > 0, within=10.0)  # the late answer's lease back
    assert store.answered == 1 and store.releases == 1
    assert await store.inner.inflight([engine.snapshot.limiters[0].op(  # type: ignore[union-attr]
        engine.context(get()), True).key]) == [0]


def _half_open(engine: Engine, clock: ManualClock) -> None:
    for _ in range(engine.gate.breaker.threshold):
        engine.gate.breaker.failure()
    assert engine.gate.breaker.state == "open"
    clock.advance(engine.gate.breaker.open_for)
    assert engine.gate.breaker.state == "half_open"


async def test_a_half_open_probe_cut_short_by_the_time_left_does_not_keep_the_breaker_open(
        tmp_path: Path, clock: ManualClock) -> None:
    """The probe's store call given up (the check's time left ran out) leaves no probe taken:
    a later check probes the store and closes the breaker (it used to fail every check
    ``circuit_open`` until a restart)."""
    policy = policy_from(tmp_path, {**RULES, "limiters": [RATE]})
    store = _LateStore(MemoryStore(clock))
    engine = Engine(StoreGate(store, clock=clock, deadline=30.0), policy)
    _half_open(engine, clock)
    d = await asyncio.wait_for(engine.decide(engine.context(get()), 0.05), 10.0)
    assert d.failures == ("overload",)  # the probe's call outlived the time left
    store.go.set()
    clock.advance(10.0)
    d = await asyncio.wait_for(engine.decide(engine.context(get()), 0.2), 10.0)
    assert d.failures == () and d.allowed, d
    assert engine.gate.breaker.state == "closed" and "circuit_open" not in engine.failures


async def test_a_half_open_probe_whose_check_envoy_cancels_does_not_keep_the_breaker_open(
        tmp_path: Path, clock: ManualClock) -> None:
    policy = policy_from(tmp_path, {**RULES, "limiters": [RATE]})
    store = _LateStore(MemoryStore(clock))
    engine = Engine(StoreGate(store, clock=clock, deadline=30.0), policy)
    _half_open(engine, clock)
    task = asyncio.ensure_future(engine.decide(engine.context(get())))
    await eventually(lambda: not engine.gate.breaker.would_allow(), within=10.0)  # the probe taken
    task.cancel()  # Envoy reset the Check while the probe's store call was out
    with pytest.raises(asyncio.CancelledError):
        await task
    store.go.set()
    d = await asyncio.wait_for(engine.decide(engine.context(get())), 10.0)
    assert d.failures == () and d.allowed, d
    assert engine.gate.breaker.state == "closed"
