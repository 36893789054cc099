"""Floods cost nothing (extauthz/limiters/refusals.py): a refused user is answered locally,
identically to the store, until its bucket would admit again; shadow limiters never block
from it; the cache is bounded. Timelines on an injected clock; store calls counted on a
real store subclass."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Kind, Outcome, Verdict
from extauthz.engine.answers import denial
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.limiters import RequestRateLimiter
from extauthz.limiters.refusals import RefusalCache
from extauthz.store.base import CheckResult, Op
from extauthz.store.memory import MemoryStore

from .helpers import get, policy_from

RATE = {"name": "user-rate", "type": "request_rate", "rate": 10, "burst": 5}


class CountingStore(MemoryStore):
    """The embedded store, counting the check calls that reach it."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.calls = 0

    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        self.calls += 1
        return await super().check(ops, lease_id)


def engines(tmp_path: Path, clock: ManualClock, limiter: dict[str, object]
            ) -> tuple[Engine, CountingStore, Engine, CountingStore]:
    """One engine with the refusal cache, one without it, each on a store of its own."""
    policy = policy_from(tmp_path, {"limiters": [limiter]})
    cached_store, plain_store = CountingStore(clock), CountingStore(clock)
    cached = Engine(StoreGate(cached_store, clock=clock), policy)
    plain = Engine(StoreGate(plain_store, clock=clock), policy)
    for lim in plain.snapshot.limiters:
        assert isinstance(lim, RequestRateLimiter)
        lim.refusals = None
    return cached, cached_store, plain, plain_store


async def test_a_flood_gets_the_stores_answers_without_store_calls(
        tmp_path: Path, clock: ManualClock) -> None:
    cached, cached_store, plain, plain_store = engines(tmp_path, clock, RATE)
    refused_without_call = 0
    for step in range(300):  # 3.9 s: several refusal windows and refills
        for key in ("sk_flood", "sk_flood", "sk_flood", f"sk_other{step % 7}"):
            calls = cached_store.calls
            ctx_a, a = await cached.check(get(key=key))
            ctx_b, b = await plain.check(get(key=key))
            assert a.allowed == b.allowed, (step, key)
            if a.allowed:
                continue
            assert a.denied_by is not None and b.denied_by is not None
            assert a.denied_by.limiter == b.denied_by.limiter == "user-rate"
            assert a.denied_by.retry_after is not None and b.denied_by.retry_after is not None
            assert abs(a.denied_by.retry_after - b.denied_by.retry_after) < 1e-9
            assert abs((a.denied_by.remaining or 0) - (b.denied_by.remaining or 0)) < 1e-9
            assert abs((a.denied_by.reset or 0) - (b.denied_by.reset or 0)) < 1e-9
            # The same 429: status, Retry-After, RateLimit headers and body.
            assert denial(ctx_a, a) == denial(ctx_b, b), (step, key)
            refused_without_call += cached_store.calls == calls
        clock.advance(0.013)
    assert refused_without_call > 500  # the flood's refusals after the first of each window
    assert plain_store.calls == 1200  # every request asked the store
    assert cached_store.calls == 1200 - refused_without_call
    limiter = cached.snapshot.limiters[0]
    assert isinstance(limiter, RequestRateLimiter) and limiter.refusals is not None
    assert limiter.refusals.hits == refused_without_call


async def test_the_cached_refusal_ends_when_the_bucket_admits_again(
        tmp_path: Path, clock: ManualClock) -> None:
    cached, store, _, _ = engines(tmp_path, clock, dict(RATE, rate=2, burst=1))
    assert (await cached.check(get()))[1].allowed
    _, first = await cached.check(get())
    assert first.denied_by is not None and first.denied_by.retry_after == 0.5
    calls = store.calls
    clock.advance(0.499)
    _, d = await cached.check(get())
    assert not d.allowed and store.calls == calls  # still inside the window: no store call
    assert d.denied_by is not None and abs((d.denied_by.retry_after or 0) - 0.001) < 1e-9
    clock.advance(0.001)
    _, d = await cached.check(get())
    assert d.allowed and store.calls == calls + 1  # the store was asked, and admitted


async def test_shadow_refusals_never_block_and_are_not_cached(
        tmp_path: Path, clock: ManualClock) -> None:
    cached, store, _, _ = engines(tmp_path, clock, dict(RATE, burst=2, mode="shadow"))
    for _ in range(20):
        _, d = await cached.check(get())
        assert d.allowed
    assert store.calls == 20
    assert any(v.outcome is Outcome.SHADOW_DENIED for v in d.verdicts)
    limiter = cached.snapshot.limiters[0]
    assert isinstance(limiter, RequestRateLimiter) and limiter.refusals is not None
    assert len(limiter.refusals) == 0 and limiter.refusals.hits == 0


def _refused(retry_after: float) -> Verdict:
    return Verdict("r", Kind.RATE_LIMITER, Outcome.DENIED, limit=5, remaining=0.0,
                   retry_after=retry_after, reset=0.5)


def test_the_cache_is_bounded_and_forgets_expired_refusals(clock: ManualClock) -> None:
    cache = RefusalCache(clock, max_entries=3)
    for i in range(5):
        cache.remember(f"k{i}", _refused(10.0), 10, 5, 1)
    assert len(cache) == 3
    assert cache.refusal("k0", 10, 5, 1) is None  # the oldest went first
    assert cache.refusal("k4", 10, 5, 1) is not None
    cache.remember("short", _refused(0.1), 10, 5, 1)  # full: evicts the oldest (k2)
    assert len(cache) == 3
    clock.advance(0.2)
    cache.remember("k5", _refused(10.0), 10, 5, 1)  # the expired one goes first
    assert cache.refusal("short", 10, 5, 1) is None
    assert cache.refusal("k3", 10, 5, 1) is not None and cache.refusal("k5", 10, 5, 1) is not None
    # Other numbers (a reload, another plan): the remembered refusal does not apply.
    assert cache.refusal("k3", 20, 5, 1) is None
    # Nothing but enforced denials with a retry time is remembered.
    cache.remember("shadow", Verdict("r", Kind.RATE_LIMITER, Outcome.SHADOW_DENIED,
                                     retry_after=1.0), 10, 5, 1)
    assert cache.refusal("shadow", 10, 5, 1) is None
