"""A model of Envoy 1.40's rate limit quota filter in front of one or more quota books
(docs/rlqs.md), on an injected clock: the promise's property tests drive it
(``tests/fuzz/test_fuzz_quota.py``: one book; ``tests/store/test_quota_cooling.py``: several
replicas' books on one store, memory and real Redis).

The model follows what docs/rlqs.md verified of Envoy 1.40: a token bucket refills
continuously (``tokens_per_fill`` per ``fill_interval``); each request takes one token; a
changed token bucket keeps its ratio of tokens left; a new token bucket (none before, or a
DENY_ALL before) starts full; no assignment and an expired one are DENY_ALL (the generated
config); reports every 5 s with ``time_elapsed`` rounded down to whole seconds (0 on a
bucket's first report); a change of only the fill interval's seconds is ignored."""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import (
    MARKER_TOTAL,
    MARKER_TTL,
    REPORT_INTERVAL,
    Action,
    QuotaBook,
    QuotaLimit,
    StoreLedger,
    Stream,
    Usage,
)
from extauthz.store.base import SliceOp, Store
from extauthz.store.keys import Keys

BUCKET = {"limiter": "per-ip", "ip": "10.0.0.1"}
#: limits (rate, burst) whose bursts are many seconds of fill deep: released burst outlasts
#: a shrink's confirmation
WIDE_LIMITS = [(0.5, 2.0), (1.0, 4.0), (0.2, 3.0), (0.5, 10.0), (1.0, 20.0), (2.0, 30.0), (0.2, 6.0)]


def established(keys: Keys, replica: str = "established") -> list[SliceOp]:
    """The op that writes another replica's ledger marker: a store some replica has used
    before (a test about something else than a new store's first settle, which grows nothing
    for two report intervals: docs/rlqs.md "A store that loses its data")."""
    return [SliceOp(keys.quota_marker, MARKER_TOTAL, MARKER_TTL, replica, 1)]


@dataclass
class EnvoyBucket:
    """One Envoy's token bucket for BUCKET (deny: no assignment, DENY_ALL)."""

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
    #: the replica (book name) its stream is on, and the stream
    replica: str = ""
    stream: Stream | None = None
    allowed: int = 0
    denied: int = 0
    last_report: float | None = None


class World:
    """Envoys in front of ``replicas`` books: 0 is one book with no store ledger (one
    replica); otherwise each book has a :class:`StoreLedger` on ``store`` (one clock), an
    Envoy's stream is on one of them and moves when it breaks, and a replica may restart
    (a new book and holder name; its Envoys' streams break and reconnect)."""

    def __init__(self, rng: random.Random, envoys: int, rate: float, burst: float, *, replicas: int = 0,
                 store: Store | None = None, clock: ManualClock | None = None, keys: Keys | None = None,
                 wipe: Callable[[], None] | None = None) -> None:
        self.rng = rng
        #: the store loses its data (FLUSHALL on Redis, ``testinfra.probes.flushall``): run's ``wipes``
        self.wipe = wipe
        self.wiped: list[float] = []
        self.clock = clock if clock is not None else ManualClock(0.0)
        self.limit = QuotaLimit(rate, burst)
        self.store = store
        self.keys = keys if keys is not None else Keys()
        self.books: dict[str, QuotaBook] = {}
        self._restarts = 0
        for n in range(max(1, replicas)):
            self._start(f"r{n}")
        self.envoys = [Envoy(replica=self.rng.choice(list(self.books))) for _ in range(envoys)]
        self.admitted: list[float] = []
        self.delivered: dict[tuple[str, int], float] = {}
        self.events: list[tuple[float, int, str, int, object]] = []
        self._seq = 0
        for i in range(envoys):
            self.at(rng.uniform(0, REPORT_INTERVAL), "tick", i)

    def _start(self, name: str) -> None:
        ledger = None if self.store is None else StoreLedger(self.store, self.keys, replica=name)
        self.books[name] = QuotaBook(lambda: {"per-ip": self.limit}, clock=self.clock, ledger=ledger)

    def restart_replica(self, name: str) -> None:
        """A replica restarts: its book is gone (nothing given back: the store's slices
        pass their TTL), a new one with a new holder name takes its place."""
        del self.books[name]
        self._restarts += 1
        new = f"{name.split('-')[0]}-{self._restarts}"
        self._start(new)
        for envoy in self.envoys:
            if envoy.replica == name:
                envoy.replica, envoy.stream = new, None

    def at(self, when: float, what: str, who: int, arg: object = None) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, what, who, arg))

    async def report(self, i: int) -> None:
        envoy = self.envoys[i]
        now = self.clock.monotonic()
        book = self.books[envoy.replica]
        if envoy.stream is None:
            envoy.stream = book.open(f"envoy{i}")
        elapsed = 0.0 if envoy.last_report is None else float(math.floor(now - envoy.last_report))
        usage = Usage(BUCKET, elapsed, envoy.allowed, envoy.denied)
        envoy.allowed = envoy.denied = 0
        envoy.last_report = now
        out = await book.settle(book.report(envoy.stream, "edge", [usage]))
        for sid, actions in out.items():
            for j, other in enumerate(self.envoys):
                if other.stream is not None and other.replica == envoy.replica and other.stream.id == sid:
                    # one stream delivers in order: a later answer never overtakes
                    where = (envoy.replica, sid)
                    when = max(now + self.rng.choice([0.0, 0.0, 0.01, 0.5, 2.0]), self.delivered.get(where, now))
                    self.delivered[where] = when
                    for action in actions:
                        self.at(when, "apply", j, (other.stream, action))

    async def run(self, seconds: float, weights: list[float], mean_gap: float, restarts: float = 0.0,
                  reconnects: float = 0.0, replica_restarts: float = 0.0, wipes: float = 0.0) -> None:
        """``restarts``, ``reconnects``: per Envoy tick, the chance that its Envoy restarts
        (buckets gone) or its stream breaks (buckets kept; with replicas, it reconnects to
        any); ``replica_restarts``: per tick, the chance a replica restarts; ``wipes``: per
        tick, the chance the store loses its data (``wipe``)."""
        self.at(self.clock.monotonic() + self.rng.expovariate(1 / mean_gap), "request", -1)
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
                if self.store is not None and self.rng.random() < replica_restarts:
                    self.restart_replica(self.rng.choice(list(self.books)))
                if self.wipe is not None and self.rng.random() < wipes:
                    self.wipe()
                    self.wiped.append(now)
                if envoy.stream is not None and self.rng.random() < restarts:
                    # the Envoy restarts: its buckets are gone, its stream closes
                    self.books[envoy.replica].close(envoy.stream)
                    self.envoys[who] = Envoy(replica=self.rng.choice(list(self.books)))
                elif envoy.stream is not None and self.rng.random() < reconnects:
                    # the stream breaks: Envoy keeps enforcing what it has, reconnects next
                    # tick (to any replica)
                    self.books[envoy.replica].close(envoy.stream)
                    envoy.stream = None
                    envoy.replica = self.rng.choice(list(self.books))
                else:
                    await self.report(who)
                self.at(now + REPORT_INTERVAL, "tick", who)
            elif what == "apply":
                stream, action = arg  # type: ignore[misc]
                envoy = self.envoys[who]
                if envoy.stream is stream:  # still that stream
                    envoy.bucket.apply(action, now)

    def worst_excess(self, rate: float, burst: float, since: float = 0.0) -> float:
        """The most any window of admitted requests (from ``since``) passed ``rate x t + burst``."""
        times = [t for t in self.admitted if t >= since]
        worst = -math.inf
        for i in range(len(times)):
            for j in range(i, len(times)):
                worst = max(worst, (j - i + 1) - (rate * (times[j] - times[i]) + burst))
        return worst


async def two_replicas(world: World, envoys: int) -> None:
    """The timeline of the two-replica tests: five spells of 10-30 s, demand moved between
    the Envoys at each; Envoys restart, streams break and move, replicas restart."""
    rng = world.rng
    for _ in range(5):
        weights = [rng.choice([0.0, 0.1, 1.0, 9.0]) for _ in range(envoys)]
        await world.run(rng.uniform(10, 30), weights, mean_gap=rng.choice([0.05, 0.2]),
                        restarts=0.05, reconnects=0.2, replica_restarts=0.03)


async def three_replicas(world: World, envoys: int) -> None:
    """Five spells of 10-30 s, demand moved between the Envoys at each; Envoys restart,
    streams break and move, and a replica restarts at one tick in seven (mid-cooling: what
    it released cools only in the store's slices, its memory gone). Meant for three
    replicas: a replica's report then often settles several of its streams' holds of the
    bucket at once."""
    rng = world.rng
    for _ in range(5):
        weights = [rng.choice([0.0, 0.1, 1.0, 9.0]) for _ in range(envoys)]
        await world.run(rng.uniform(10, 30), weights, mean_gap=rng.choice([0.05, 0.2]),
                        restarts=0.05, reconnects=0.2, replica_restarts=0.15)


async def wiped_ledger(world: World, envoys: int) -> None:
    """Five spells of 10-30 s, demand moved between the Envoys at each, streams breaking and
    moving, and the store losing its data at one tick in forty (the ledger gone while the
    Envoys enforce what they were sent)."""
    rng = world.rng
    for _ in range(5):
        weights = [rng.choice([0.0, 0.1, 1.0, 9.0]) for _ in range(envoys)]
        await world.run(rng.uniform(10, 30), weights, mean_gap=rng.choice([0.05, 0.2]),
                        restarts=0.03, reconnects=0.1, replica_restarts=0.02, wipes=1 / 40)


def drawn(seed: int) -> tuple[random.Random, tuple[float, float], int]:
    """A timeline's generator with its limit (of :data:`WIDE_LIMITS`) and its number of
    Envoys (2-5) drawn from the seed."""
    rng = random.Random(seed)
    limit = rng.choice(WIDE_LIMITS)
    return rng, limit, rng.randint(2, 5)
