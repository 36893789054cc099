"""The quota service's promise, property-style, through a model of Envoy 1.40's quota filter:
requests admitted by every Envoy holding one bucket, over any window t, never exceed the
limiter's ``rate x t + burst`` (docs/rlqs.md), through shares moving between Envoys, Envoys
restarting, streams closing and reopening, answers delayed on the way, a lowered limit.

The model follows what docs/rlqs.md verified of Envoy 1.40: a token bucket refills
continuously (``tokens_per_fill`` per ``fill_interval``); each request takes one token; a
changed token bucket keeps its ratio of tokens left; a new token bucket (none before, or a
DENY_ALL before) starts full; no assignment and an expired one are DENY_ALL (the generated
config); reports every 5 s with ``time_elapsed`` rounded down to whole seconds (0 on a
bucket's first report); a change of only the fill interval's seconds is ignored. Every event
runs on an injected clock."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import REPORT_INTERVAL, Action, QuotaBook, QuotaLimit, Stream, Usage

BUCKET = {"limiter": "per-ip", "ip": "10.0.0.1"}


@dataclass
class EnvoyBucket:
    """One Envoy's token bucket for BUCKET (None max: no assignment, DENY_ALL)."""

    max_tokens: int = 0
    fill: int = 0
    interval: int = 1
    tokens: float = 0.0
    at: float = 0.0
    expires: float = 0.0
    deny: bool = True

    def refill(self, now: float) -> None:
        if not self.deny:
            self.tokens = min(float(self.max_tokens), self.tokens + (now - self.at) * self.fill / self.interval)
        self.at = now

    def apply(self, action: Action, now: float) -> None:
        self.refill(now)
        if action.share is None:  # abandon: the bucket and its usage wiped
            self.deny, self.max_tokens, self.tokens, self.expires = True, 0, 0.0, 0.0
            return
        self.expires = now + action.ttl
        if action.deny or not (action.share.fill and action.share.burst):
            self.deny, self.max_tokens, self.tokens = True, 0, 0.0
            return
        if self.deny:  # a new token bucket starts full
            self.tokens = float(action.share.burst)
        elif action.share.burst != self.max_tokens or action.share.fill != self.fill:
            self.tokens = self.tokens / self.max_tokens * action.share.burst  # the ratio kept
        elif self.interval != action.interval:  # only the seconds changed: Envoy 1.40 ignores it
            return
        self.deny = False
        self.max_tokens, self.fill, self.interval = action.share.burst, action.share.fill, action.interval

    def take(self, now: float) -> bool:
        if self.deny or now >= self.expires:
            return False
        self.refill(now)
        if self.tokens >= 1 - 1e-9:
            self.tokens -= 1
            return True
        return False


@dataclass
class Envoy:
    bucket: EnvoyBucket = field(default_factory=EnvoyBucket)
    stream: Stream | None = None
    allowed: int = 0
    denied: int = 0
    last_report: float | None = None


class World:
    def __init__(self, rng: random.Random, envoys: int, rate: float, burst: float) -> None:
        self.rng = rng
        self.clock = ManualClock(0.0)
        self.limit = QuotaLimit(rate, burst)
        self.book = QuotaBook(lambda: {"per-ip": self.limit}, clock=self.clock)
        self.envoys = [Envoy() for _ in range(envoys)]
        self.admitted: list[float] = []
        self.delivered: dict[int, float] = {}
        self.events: list[tuple[float, int, str, int, object]] = []
        self._seq = 0
        for i in range(envoys):
            self.at(rng.uniform(0, REPORT_INTERVAL), "tick", i)

    def at(self, when: float, what: str, who: int, arg: object = None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, what, who, arg))

    def report(self, i: int) -> None:
        envoy = self.envoys[i]
        now = self.clock.monotonic()
        if envoy.stream is None:
            envoy.stream = self.book.open(f"envoy{i}")
        elapsed = 0.0 if envoy.last_report is None else float(math.floor(now - envoy.last_report))
        usage = Usage(BUCKET, elapsed, envoy.allowed, envoy.denied)
        envoy.allowed = envoy.denied = 0
        envoy.last_report = now
        out = self.book.report(envoy.stream, "edge", [usage])
        for sid, actions in out.items():
            for j, other in enumerate(self.envoys):
                if other.stream is not None and other.stream.id == sid:
                    # one stream delivers in order: a later answer never overtakes
                    when = max(now + self.rng.choice([0.0, 0.0, 0.01, 0.5, 2.0]), self.delivered.get(sid, now))
                    self.delivered[sid] = when
                    for action in actions:
                        self.at(when, "apply", j, (sid, action))

    def run(self, seconds: float, weights: list[float], mean_gap: float,
            restarts: float = 0.0, reconnects: float = 0.0) -> None:
        self.at(self.rng.expovariate(1 / mean_gap), "request", -1)
        end = self.clock.monotonic() + seconds
        while self.events and self.events[0][0] <= end:
            when, _, what, who, arg = heapq.heappop(self.events)
            self.clock.set(max(self.clock.monotonic(), when))
            now = self.clock.monotonic()
            if what == "request":
                if not any(weights):
                    self.at(now + mean_gap, "request", -1)
                    continue
                i = self.rng.choices(range(len(self.envoys)), weights)[0]
                envoy = self.envoys[i]
                if envoy.bucket.take(now):
                    envoy.allowed += 1
                    self.admitted.append(now)
                else:
                    envoy.denied += 1
                self.at(now + self.rng.expovariate(1 / mean_gap), "request", -1)
            elif what == "tick":
                envoy = self.envoys[who]
                if envoy.stream is not None and self.rng.random() < restarts:
                    # the Envoy restarts: its buckets are gone, its stream closes
                    self.book.close(envoy.stream)
                    self.envoys[who] = Envoy()
                elif envoy.stream is not None and self.rng.random() < reconnects:
                    # the stream breaks: Envoy keeps enforcing what it has, reconnects next tick
                    self.book.close(envoy.stream)
                    envoy.stream = None
                else:
                    self.report(who)
                self.at(now + REPORT_INTERVAL, "tick", who)
            elif what == "apply":
                sid, action = arg  # type: ignore[misc]
                envoy = self.envoys[who]
                if envoy.stream is not None and envoy.stream.id == sid:  # still that stream
                    envoy.bucket.apply(action, now)

    def worst_excess(self, rate: float, burst: float, since: float = 0.0) -> float:
        """The most any window of admitted requests (from ``since``) passed ``rate x t + burst``."""
        times = [t for t in self.admitted if t >= since]
        worst = -math.inf
        for i in range(len(times)):
            for j in range(i, len(times)):
                worst = max(worst, (j - i + 1) - (rate * (times[j] - times[i]) + burst))
        return worst


LIMITS = st.sampled_from([(0.5, 2.0), (1.0, 4.0), (2.0, 4.0), (3.0, 10.0), (0.2, 3.0)])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(1, 4), limit=LIMITS)
def test_admitted_never_exceed_rate_t_plus_burst_as_shares_move(seed: int, envoys: int,
                                                                 limit: tuple[float, float]) -> None:
    rng = random.Random(seed)
    world = World(rng, envoys, *limit)
    # demand moves between the Envoys every 10-30 s
    for _ in range(4):
        weights = [rng.choice([0.0, 0.1, 1.0, 9.0]) for _ in range(envoys)]
        world.run(rng.uniform(10, 30), weights, mean_gap=rng.choice([0.05, 0.2, 1.0]))
    assert world.worst_excess(*limit) <= 1e-6


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(1, 3), limit=LIMITS)
def test_the_promise_holds_through_restarts_and_reconnects(seed: int, envoys: int,
                                                          limit: tuple[float, float]) -> None:
    rng = random.Random(seed)
    world = World(rng, envoys, *limit)
    for _ in range(4):
        weights = [rng.choice([0.0, 0.1, 1.0, 9.0]) for _ in range(envoys)]
        world.run(rng.uniform(10, 30), weights, mean_gap=rng.choice([0.05, 0.2]),
                  restarts=0.1, reconnects=0.15)
    assert world.worst_excess(*limit) <= 1e-6


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), envoys=st.integers(1, 3), limit=LIMITS, lower=st.sampled_from([0.25, 0.5]))
@example(seed=20, envoys=3, limit=(2.0, 4.0), lower=0.25)  # the interval alone changed for one Envoy
def test_a_lowered_limit_holds_from_one_report_and_delivery_after_the_reload(
        seed: int, envoys: int, limit: tuple[float, float], lower: float) -> None:
    rng = random.Random(seed)
    world = World(rng, envoys, *limit)
    world.run(rng.uniform(10, 30), [rng.choice([0.1, 1.0, 9.0]) for _ in range(envoys)], mean_gap=0.05)
    assert world.worst_excess(*limit) <= 1e-6
    reloaded = world.clock.monotonic()
    rate, burst = limit[0] * lower, max(1.0, limit[1] * lower)
    world.limit = QuotaLimit(rate, burst)  # read at the next report, shrinks pushed to every Envoy
    for _ in range(3):
        world.run(rng.uniform(10, 20), [rng.choice([0.1, 1.0, 9.0]) for _ in range(envoys)], mean_gap=0.05)
    # every Envoy reports within 5 s and its answer arrives within 2 s (the model's delays)
    assert world.worst_excess(rate, burst, since=reloaded + REPORT_INTERVAL + 2.0) <= 1e-6
