"""The rate limit quota service's logic (RLQS, docs/rlqs.md): Envoy decides, this divides.

Envoy's ``rate_limit_quota`` filter holds a token bucket per bucket id and streams usage
reports; this module decides what each stream's buckets get. No grpc here: the server's
adapter (``server/services.py`` :class:`~extauthz.server.services.RateLimitQuotaService`)
turns reports into :meth:`QuotaBook.report` calls and the returned :class:`Action` lists
into ``RateLimitQuotaResponse`` messages.

* A bucket id names a ``request_rate`` limiter (``limiter: NAME``) and the key parts Envoy
  built; streams holding the same bucket id share that limiter's ``rate`` and ``burst``.
* :func:`divide` (pure) splits them into whole tokens: shares follow the reported demand,
  and a share grows only into what is free in the ledger, where a shrunk share stays held
  until a report sent after Envoy received the shrink confirms it (:attr:`Held.until`).
  The ledger here is this replica's (:class:`QuotaBook`); a store ledger across replicas
  replaces it by holding the same :class:`Share` numbers per (bucket, stream) under a TTL.
* Assignments carry a TTL of a few report intervals; a bucket that reports no requests for
  ``idle_reports`` reports is abandoned (its share goes back); a stream gone gives its
  shares back once its assignments' TTL has passed (its Envoy enforces them until then).
* Envoy 1.40 uses a token bucket's ``fill_interval`` in whole seconds and ignores a change
  of its seconds (it compares only the nanoseconds), so a limiter's interval is fixed:
  ``ceil(1 / rate)`` seconds (at least 1) and only ``tokens_per_fill``/``max_tokens`` vary.
* Over-admission is computed from the reports against the ledger: a report allowing more
  than the stream's share (its rate over the time elapsed plus its burst) counts the excess
  (``extauthz_quota_overadmission_total``, must stay 0).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from .clock import SYSTEM_CLOCK, Clock
from .policy.model import Policy

K = TypeVar("K", bound=Hashable)

#: the bucket id's entry naming the limiter
LIMITER_KEY = "limiter"
#: Envoy 1.40 reports every 5 s whatever the filter's reporting_interval says
REPORT_INTERVAL = 5.0
#: an assignment lives this many report intervals (refreshed by every report)
TTL_REPORTS = 3
#: reports in a row with no request before a bucket is abandoned
IDLE_REPORTS = 6
#: every stream's weight gets this part of the mean demand, so a quiet stream keeps a share
FLOOR_WEIGHT = 0.1
#: a report's counts and seconds are taken up to this (finite, bounded numbers only)
MAX_REPORTED = 10**12
#: Envoy 1.40's time_elapsed is whole seconds, rounded down
ELAPSED_ROUNDING = 1.0
#: bounds (docs/rlqs.md)
MAX_STREAMS = 1024
MAX_BUCKETS_PER_STREAM = 4096
#: (bucket, stream) holds in all (each at most a bucket id's bytes and a few numbers)
MAX_HOLDS = 1 << 18
MAX_BUCKET_ENTRIES = 8
MAX_BUCKET_ID_BYTES = 512
MAX_DOMAIN_BYTES = 128


class QuotaError(ValueError):
    """A report the service refuses (its stream ends with the reason)."""


@dataclass(frozen=True, slots=True)
class Share:
    """Whole tokens: ``fill`` per fill interval, up to ``burst``."""

    fill: int
    burst: int

    def __post_init__(self) -> None:
        if self.fill < 0 or self.burst < 0:
            raise ValueError("a share is never negative")


NOTHING = Share(0, 0)


@dataclass(frozen=True, slots=True)
class QuotaLimit:
    """A ``request_rate`` limiter served in Envoy: ``rate`` per second up to ``burst``, each
    request one token (Envoy takes one per request: a cost divides both)."""

    rate: float
    burst: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and math.isfinite(self.burst)) or self.rate <= 0 or self.burst < 0:
            raise ValueError("a quota limit needs a finite rate > 0 and burst >= 0")

    @property
    def interval(self) -> int:
        """The fill interval, whole seconds: the smallest in which at least one token fills."""
        return max(1, math.ceil(1.0 / self.rate - 1e-9))

    @property
    def total(self) -> Share:
        """What is divided: whole tokens per interval and of burst (rounded down: never more)."""
        return Share(math.floor(self.rate * self.interval + 1e-9), math.floor(self.burst + 1e-9))


def _split(total: int, weights: Mapping[K, float]) -> dict[K, int]:
    """``total`` whole tokens in proportion to ``weights`` (largest remainders; ties by order)."""
    keys = list(weights)
    mass = sum(weights.values())
    if not keys:
        return {}
    if mass <= 0:
        weights = {k: 1.0 for k in keys}
        mass = float(len(keys))
    exact = {k: total * weights[k] / mass for k in keys}
    out = {k: math.floor(exact[k] + 1e-9) for k in keys}
    left = total - sum(out.values())
    for k in sorted(keys, key=lambda k: out[k] - exact[k])[:max(0, left)]:
        out[k] += 1
    return out


def _grow_within(total: int, targets: Mapping[K, int], held: Mapping[K, int]) -> dict[K, int]:
    """Shrinks at once; growth only into ``total`` minus what the ledger holds."""
    out = {k: min(t, held.get(k, 0)) for k, t in targets.items()}
    free = total - sum(held.values())
    for k, t in targets.items():
        grow = min(max(0, t - out[k]), max(0, free))
        out[k] += grow
        free -= grow
    return out


def divide(limit: Share, demand: Mapping[K, float], held: Mapping[K, Share]) -> dict[K, Share]:
    """Each stream's new share of ``limit``.

    ``demand``: the requests each stream's bucket saw per second lately (allowed and denied);
    ``held``: what the ledger holds for each (a stream's current share, or a larger one not
    yet confirmed shrunk; streams not in ``demand`` still hold theirs). Shares follow demand
    (every stream weighted at least :data:`FLOOR_WEIGHT` of the mean); a share grows only into
    what no stream holds, so with ``sum(held) <= limit`` the shares and the ledger never sum
    past ``limit`` in either number, whatever the order the answers reach Envoy.
    """
    if not demand:
        return {}
    mean = sum(max(0.0, d) for d in demand.values()) / len(demand)
    weights = {k: max(0.0, d) + FLOOR_WEIGHT * mean for k, d in demand.items()}
    fills = _grow_within(limit.fill, _split(limit.fill, weights), {k: s.fill for k, s in held.items()})
    bursts = _grow_within(limit.burst, _split(limit.burst, weights), {k: s.burst for k, s in held.items()})
    return {k: Share(fills[k], bursts[k]) for k in demand}


def limits_of(policy: Policy) -> dict[str, QuotaLimit]:
    """The limiters a bucket id may name: the policy's ``request_rate`` limiters with
    ``enforce: envoy``, by name, in Envoy's tokens (one per request: ``rate``/``cost`` and
    ``burst``/``cost``). Plans and overrides are not served in Envoy (a bucket id carries no
    plan; the policy refuses them there)."""
    out: dict[str, QuotaLimit] = {}
    for spec in policy.limiters:
        if spec.type == "request_rate" and spec.enforce == "envoy":
            out[spec.name] = QuotaLimit(spec.rate / spec.cost, spec.burst / spec.cost)
    return out


# -- the replica's book: streams, buckets, the ledger ------------------------------------

BucketKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Action:
    """One bucket action for a stream: ``share`` None is an abandon; ``deny`` a DENY_ALL
    blanket rule (a bucket of no limiter served here); else a token bucket."""

    bucket: BucketKey
    share: Share | None
    interval: int = 1
    ttl: float = 0.0
    deny: bool = False


@dataclass(slots=True)
class Held:
    """A stream's hold on one bucket: ``share`` as last sent; ``ledger`` what the ledger
    counts (a shrunk share's old size until ``until``: a report arriving after it confirms)."""

    share: Share = NOTHING
    ledger: Share = NOTHING
    until: float = 0.0
    demand: float = 0.0
    idle: int = 0
    allowed: int = 0
    denied: int = 0
    reported: float = 0.0
    #: abandoned (idle): Envoy drops the bucket when the abandon reaches it, and enforces the
    #: last assignment until then (up to its TTL): the ledger holds it until ``until``
    abandoned: bool = False


@dataclass(slots=True)
class Stream:
    id: int
    peer: str
    domain: str = ""
    opened: float = 0.0
    #: a closed stream's Envoy keeps enforcing its last assignments until their TTL: its
    #: holds stay in the ledger until then (0: open)
    gone_at: float = 0.0
    buckets: dict[BucketKey, Held] = field(default_factory=dict)


def bucket_key(bucket: Mapping[str, str]) -> BucketKey:
    """The bucket id as a key (the order of its entries does not matter); bounded."""
    if not bucket:
        raise QuotaError("a bucket id has no entries")
    if len(bucket) > MAX_BUCKET_ENTRIES:
        raise QuotaError(f"a bucket id has {len(bucket)} entries (at most {MAX_BUCKET_ENTRIES})")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in bucket.items())
    if size > MAX_BUCKET_ID_BYTES:
        raise QuotaError(f"a bucket id of {size} bytes (at most {MAX_BUCKET_ID_BYTES})")
    return tuple(sorted(bucket.items()))


@dataclass(frozen=True, slots=True)
class Usage:
    """One bucket's entry of a report: its id, the seconds since its last report (0 on its
    first), and the requests Envoy allowed and denied meanwhile."""

    bucket: Mapping[str, str]
    elapsed: float
    allowed: int
    denied: int


class QuotaBook:
    """This replica's streams, their buckets and the ledger of shares (one per server).

    ``limits()`` gives the limiters served in Envoy by name (read at every report: a reload
    takes effect at the next report; a lowered limit shrinks shares at once and grows none
    until the ledger is under it)."""

    def __init__(self, limits: Callable[[], Mapping[str, QuotaLimit]], *, clock: Clock = SYSTEM_CLOCK,
                 report_interval: float = REPORT_INTERVAL, max_streams: int = MAX_STREAMS,
                 max_buckets: int = MAX_BUCKETS_PER_STREAM, max_holds: int = MAX_HOLDS) -> None:
        self.limits = limits
        self.clock = clock
        self.report_interval = report_interval
        self.max_streams = max_streams
        self.max_buckets = max_buckets
        self.max_holds = max_holds
        #: (bucket, stream) holds in all streams' ``buckets``
        self.holds = 0
        self.streams: dict[int, Stream] = {}
        #: bucket -> the streams holding it
        self.holders: dict[BucketKey, set[int]] = {}
        self._next = 0
        #: abandoned holds by the time they go (in order: ``until`` is now + the TTL)
        self._abandoned: deque[tuple[float, int, BucketKey]] = deque()
        #: counters for /metrics
        self.reports = 0
        self.overadmission = 0
        self.refused: dict[str, int] = {}

    @property
    def ttl(self) -> float:
        return TTL_REPORTS * self.report_interval

    # -- streams
    def open(self, peer: str) -> Stream:
        self._purge(self.clock.monotonic())
        if sum(1 for s in self.streams.values() if not s.gone_at) >= self.max_streams:
            self._refuse("streams")
            raise QuotaError(f"{self.max_streams} quota streams are open (the most this server takes)")
        self._next += 1
        stream = Stream(self._next, peer, opened=self.clock.monotonic())
        self.streams[stream.id] = stream
        return stream

    def close(self, stream: Stream) -> None:
        """The stream is gone. Its Envoy keeps enforcing the assignments it got (a lost server
        does not lift its limits) until their TTL: its shares go back only then."""
        if self.streams.get(stream.id) is stream and not stream.gone_at:
            stream.gone_at = self.clock.monotonic() + self.ttl

    def _purge(self, now: float) -> None:
        for stream in [s for s in self.streams.values() if s.gone_at and now >= s.gone_at]:
            del self.streams[stream.id]
            for key in stream.buckets:
                self._unhold(key, stream.id)
            stream.buckets.clear()
        while self._abandoned and now >= self._abandoned[0][0]:
            _, sid, key = self._abandoned.popleft()
            stream = self.streams.get(sid)
            held = stream.buckets.get(key) if stream is not None else None
            if stream is not None and held is not None and held.abandoned and now >= held.until:
                del stream.buckets[key]
                self._unhold(key, sid)

    def _unhold(self, key: BucketKey, sid: int) -> None:
        holders = self.holders.get(key)
        if holders is not None and sid in holders:
            holders.discard(sid)
            self.holds -= 1
            if not holders:
                del self.holders[key]

    def _refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    # -- reports
    def report(self, stream: Stream, domain: str, usages: Iterable[Usage]) -> dict[int, list[Action]]:
        """One report of ``stream``: the actions to send, by stream id (this one's assignments
        for every bucket it reported; other streams' shrinks when this one's demand grows)."""
        if domain:
            if len(domain.encode()) > MAX_DOMAIN_BYTES:
                raise QuotaError(f"a domain of more than {MAX_DOMAIN_BYTES} bytes")
            if stream.domain and domain != stream.domain:
                raise QuotaError("a stream's domain does not change")
            stream.domain = domain
        now = self.clock.monotonic()
        self._purge(now)
        limits = self.limits()
        self.reports += 1
        # the whole report is checked before any of it is applied: a refused report changes
        # nothing (its other streams' shrinks would be lost with it, never sent but counted)
        keyed = [(bucket_key(usage.bucket), usage) for usage in usages]
        new = {key for key, _ in keyed if key not in stream.buckets}
        if len(stream.buckets) + len(new) > self.max_buckets:
            self._refuse("buckets")
            raise QuotaError(f"a stream holds at most {self.max_buckets} buckets")
        if self.holds + len(new) > self.max_holds:
            self._refuse("buckets")
            raise QuotaError(f"{self.max_holds} buckets are held by all streams (the most this server takes)")
        out: dict[int, list[Action]] = {}
        mine = out.setdefault(stream.id, [])
        for key, usage in keyed:
            usage = Usage(usage.bucket, min(max(0.0, usage.elapsed), MAX_REPORTED),
                          min(max(0, usage.allowed), MAX_REPORTED), min(max(0, usage.denied), MAX_REPORTED))
            held = stream.buckets.get(key)
            if held is None:
                held = stream.buckets[key] = Held(reported=now)
                self.holders.setdefault(key, set()).add(stream.id)
                self.holds += 1
            self._audit(held, usage, limits.get(dict(key).get(LIMITER_KEY, "")))
            held.allowed += usage.allowed
            held.denied += usage.denied
            if usage.elapsed > 0:
                held.demand = (usage.allowed + usage.denied) / usage.elapsed
            held.idle = held.idle + 1 if usage.allowed + usage.denied == 0 and usage.elapsed > 0 else 0
            if held.abandoned:  # reported again: Envoy has the bucket (again); its hold stays
                held.abandoned, held.idle = False, 0
            if held.until and now >= held.until:  # a report sent after the shrink arrived
                held.ledger, held.until = held.share, 0.0
            held.reported = now
            if held.idle >= IDLE_REPORTS:
                # Envoy enforces its last assignment until the abandon reaches it (or the
                # assignment's TTL passes, if it never does): held until then, shared by none
                held.ledger, held.share = _max(held.ledger, held.share), NOTHING
                held.until, held.abandoned = now + self.ttl, True
                self._abandoned.append((held.until, stream.id, key))
                mine.append(Action(key, None))
                continue
            limit = limits.get(dict(key).get(LIMITER_KEY, ""))
            if limit is None:
                mine.append(Action(key, NOTHING, ttl=self.ttl, deny=True))
                continue
            self._assign(key, limit, now, out)
        return {sid: actions for sid, actions in out.items() if actions}

    def _audit(self, held: Held, usage: Usage, limit: QuotaLimit | None) -> None:
        """Requests allowed past the stream's share (the larger of what it held) count."""
        if limit is None or usage.elapsed <= 0:
            return
        share = Share(max(held.share.fill, held.ledger.fill), max(held.share.burst, held.ledger.burst))
        # Envoy 1.40 rounds time_elapsed down to whole seconds (4 s for ~4.98 s): up to 1 s more
        bound = share.fill * (usage.elapsed + ELAPSED_ROUNDING) / limit.interval + share.burst
        if usage.allowed > bound + 1e-9:
            self.overadmission += math.ceil(usage.allowed - bound)

    def _assign(self, key: BucketKey, limit: QuotaLimit, now: float, out: dict[int, list[Action]]) -> None:
        sids = sorted(self.holders.get(key, ()))
        holders = {sid: self.streams[sid].buckets[key] for sid in sids}
        live = {sid: h.demand for sid, h in holders.items() if not (self.streams[sid].gone_at or h.abandoned)}
        if len(sids) == 1 and live:  # what divide gives one stream alone: the whole limit
            shares = {sids[0]: limit.total}
        else:  # a closed stream holds its last share, gets none
            shares = divide(limit.total, live,
                            {sid: _max(h.ledger, h.share) if h.until else h.ledger for sid, h in holders.items()})
        confirm_after = now + self.report_interval / 2
        for sid, share in shares.items():
            h = holders[sid]
            changed = share != h.share
            if share.fill < h.share.fill or share.burst < h.share.burst:
                h.ledger, h.until = _max(h.ledger, h.share), confirm_after
            elif not h.until:
                h.ledger = share
            else:
                h.ledger = _max(h.ledger, share)
            h.share = share
            if changed or sid in out:  # the reporting stream gets every bucket (TTL refreshed)
                out.setdefault(sid, []).append(Action(key, share, limit.interval, self.ttl))

    # -- status
    def status(self) -> dict[str, object]:
        return {
            "streams": [{
                "id": s.id, "peer": s.peer, "domain": s.domain, "closed": bool(s.gone_at),
                "buckets": [{"bucket": shown(k), "fill": h.share.fill, "burst": h.share.burst,
                             "held": {"fill": h.ledger.fill, "burst": h.ledger.burst},
                             "demand": round(h.demand, 3), "allowed": h.allowed, "denied": h.denied}
                            for k, h in s.buckets.items()],
            } for s in self.streams.values()],
            "reports": self.reports, "overadmission": self.overadmission, "refused": dict(self.refused),
        }


#: the bucket id entries /status shows as they are (the generator's, never a credential);
#: every other entry's value is shown hashed
SHOWN_RAW = frozenset({LIMITER_KEY, "source_ip", "method"})


def shown(bucket: BucketKey) -> dict[str, str]:
    """A bucket id as /status shows it: the limiter, the client address and the method as
    they are; any other value (a header's, or an entry of a hand-written Envoy config such
    as ``api_key``: it may be a credential) as a short hash."""
    return {k: (v if k in SHOWN_RAW else "sha256:" + hashlib.sha256(v.encode()).hexdigest()[:16])
            for k, v in bucket}


def _max(a: Share, b: Share) -> Share:
    return Share(max(a.fill, b.fill), max(a.burst, b.burst))
