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
  The ledger here is this replica's (:class:`QuotaBook`); beneath it, the store's ledger
  (:class:`StoreLedger`, ``SliceOp``) holds each (bucket, stream)'s numbers across replicas
  under a TTL, and a share is sent only as far as the store granted it (:meth:`QuotaBook.settle`).
* Assignments carry a TTL of a few report intervals; a bucket that reports no requests for
  ``idle_reports`` reports is abandoned; a stream gone, or an abandoned bucket, gives its
  shares back once its assignments' TTL has passed (its Envoy enforces them until then).
* Tokens released from the ledger cool before another stream gets them (Envoy grows a
  bucket with its ratio of tokens kept and starts a new one full: tokens the releasing
  Envoy spent would come back at once): :meth:`QuotaBook._cool`, tested against a model of
  Envoy's filter in ``tests/fuzz/test_fuzz_quota.py``.
* Envoy 1.40 uses a token bucket's ``fill_interval`` in whole seconds and ignores a change
  of its seconds (it compares only the nanoseconds), so a limiter's interval is fixed:
  ``ceil(1 / rate)`` seconds (at least 1) and only ``tokens_per_fill``/``max_tokens`` vary.
* Over-admission counts only what the ledger proves: tokens of a share grown while the
  shares held sum past the limit, in this replica's ledger or the store's
  (``extauthz_quota_overadmission_total``, must stay 0). A report allowing more than the
  stream's share could is self-reported: it counts one entry in ``reported_excess``
  (``extauthz_quota_reported_excess_total``), never its requests, so a peer cannot inflate
  the first and raises the second by at most one per entry settled.
* A bucket's entry sooner than half a report interval after the stream's last one settled
  is coalesced (``extauthz_quota_coalesced_total``): a peer reporting faster than Envoy costs
  no division and no store call.
* Released burst cools in the store too (:meth:`QuotaBook._store_ask`, :func:`cool_tail`).
* A store that lost its data (the ledger gone while the Envoys enforce what they were sent)
  is found by the ledger's marker, read and renewed in every settle's store call
  (:meth:`StoreLedger.hold_marked`): no share grows until those assignments ran out and
  cooled (:meth:`QuotaBook._reset`, ``extauthz_quota_ledger_resets_total``).
* A bucket id naming a shedder and a tier (``shedder: NAME``, ``tier: T``: a
  ``worker_utilization`` shedder with ``envoy_deny_all``) holds no tokens: it is answered
  ``DENY_ALL`` while that shedder refuses the tier whole, else ``ALLOW_ALL`` (critical: always
  ``ALLOW_ALL``), at each report (:meth:`QuotaBook._shed`).
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import json
import logging
import math
import secrets
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.tiers import Tier
from ..limiters.worker import WorkerUtilizationShedder
from ..policy.classify import hash_identity
from ..policy.model import Policy
from ..store.base import OpResult, SliceOp, Store
from ..store.keys import Keys

K = TypeVar("K", bound=Hashable)

log = logging.getLogger(__name__)

#: the bucket id's entry naming the limiter
LIMITER_KEY = "limiter"
#: a shedder's bucket (``envoy_deny_all``): the entries naming the shedder and the tier
SHEDDER_KEY = "shedder"
TIER_KEY = "tier"
#: and the classification its matchers were rendered from (:func:`classification_id`)
CLASSIFICATION_KEY = "classification"
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
#: a bucket's entry arriving within this part of a report interval of the stream's last one
#: settled for it is coalesced into the next (Envoy sends one every 5 s, and one at once for
#: a bucket it has not reported: a peer reporting faster costs no division, no store call)
COALESCE_PART = 0.5
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


def _grow_within(total: int, targets: Mapping[K, int], held: Mapping[K, int], sent: Mapping[K, int],
                 reserve: int, regrow: bool) -> dict[K, int]:
    """Shrinks at once; growth into ``total`` minus what the ledger holds minus ``reserve``.
    ``regrow``: a share may grow back into what its own ledger still holds; else it grows from
    what was sent, and not at all while a shrink of it waits to be confirmed."""
    out = {k: min(t, (held if regrow else sent).get(k, 0)) for k, t in targets.items()}
    free = total - sum(held.values()) - reserve
    for k, t in targets.items():
        if not regrow and held.get(k, 0) > sent.get(k, 0):
            continue
        grow = min(max(0, t - out[k]), max(0, free))
        out[k] += grow
        free -= grow
    return out


def divide(limit: Share, demand: Mapping[K, float], held: Mapping[K, Share],
           sent: Mapping[K, Share] | None = None, reserve: Share = Share(0, 0)) -> dict[K, Share]:
    """Each stream's new share of ``limit``.

    ``demand``: the requests each stream's bucket saw per second lately (allowed and denied);
    ``held``: what the ledger holds for each (a stream's current share, or a larger one not
    yet confirmed shrunk; streams not in ``demand`` still hold theirs); ``sent``: the share
    each was last sent (``held`` if not given); ``reserve``: what may not be handed out
    (released tokens still cooling, :meth:`QuotaBook._cool`). Shares follow demand (every
    stream weighted at least :data:`FLOOR_WEIGHT` of the mean); a share grows only into what
    no stream holds and nothing reserves, and a burst never while its own shrink waits to be
    confirmed (Envoy keeps a changed bucket's ratio of tokens: growing back a shrunk bucket
    would multiply what it refilled meanwhile), so with ``sum(held) <= limit`` the shares and
    the ledger never sum past ``limit`` in either number, whatever the order the answers
    reach Envoy. A share with no fill or no burst is :data:`NOTHING` (Envoy's token bucket
    needs both: it is sent as DENY_ALL, so its burst is not held).
    """
    if not demand:
        return {}
    sent = held if sent is None else sent
    mean = sum(max(0.0, d) for d in demand.values()) / len(demand)
    weights = {k: max(0.0, d) + FLOOR_WEIGHT * mean for k, d in demand.items()}
    fills = _grow_within(limit.fill, _split(limit.fill, weights), {k: s.fill for k, s in held.items()},
                         {k: s.fill for k, s in sent.items()}, reserve.fill, True)
    bursts = _grow_within(limit.burst, _split(limit.burst, weights), {k: s.burst for k, s in held.items()},
                          {k: s.burst for k, s in sent.items()}, reserve.burst, False)
    return {k: Share(fills[k], bursts[k]) if fills[k] and bursts[k] else NOTHING for k in demand}


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


def envoy_sheds(active: Iterable[tuple[object, bool]]) -> dict[str, frozenset[str]]:
    """The shedders pushed to Envoy among the engine's active limiters (``Snapshot.active``:
    (limiter, enforce) of those whose effective mode is not off), each with the tiers it
    refuses whole now (within its ``applies_to.tiers``); one switched to shadow refuses none."""
    out: dict[str, frozenset[str]] = {}
    for lim, enforce in active:
        if isinstance(lim, WorkerUtilizationShedder) and lim.spec.envoy_deny_all:
            scope = lim.spec.applies_to.tiers
            out[lim.name] = frozenset(t.value for t in lim.shed_whole()
                                      if enforce and (scope is None or t.value in scope))
    return out


def classification_id(policy: Policy) -> str:
    """A digest of the tier sources a pushed shedder's quota filter reads as Envoy matchers
    (``test_mode.header``, then each rule in order: methods, path prefix, hosts, headers,
    tier): ``envoy-config --rlqs`` writes it into each tier bucket's id, and the book answers
    DENY_ALL only to a bucket whose digest is the policy's in force. An Envoy rendered before
    a reload changed the classification tiers requests as the check no longer does (a route
    made critical since is still Envoy's post): its buckets get ALLOW_ALL, and the check sheds
    them as before, until Envoy's config is rendered again."""
    rules = [[sorted(m.methods) if m.methods is not None else None, m.path_prefix,
              sorted(m.hosts) if m.hosts is not None else None, [list(h) for h in m.headers], rule.tier.value]
             for rule in policy.rules for m in (rule.matcher,)]
    text = json.dumps([policy.test_header, rules], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


# -- the replica's book: streams, buckets, the ledger ------------------------------------

BucketKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Action:
    """One bucket action for a stream: ``share`` None is an abandon; ``deny`` a DENY_ALL
    blanket rule (a bucket of no limiter served here, or a tier a shedder refuses whole);
    ``allow`` an ALLOW_ALL blanket rule (a shedder's tier it does not refuse whole); else a
    token bucket."""

    bucket: BucketKey
    share: Share | None
    interval: int = 1
    ttl: float = 0.0
    deny: bool = False
    allow: bool = False


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
    #: seconds of reports in a row without a request (the idle streak)
    idle_for: float = 0.0
    #: abandoned after idling long enough for its Envoy bucket to be full: the tokens Envoy
    #: drops with it were never spent, so its hold goes back without cooling
    full: bool = False
    #: the fill interval last sent (0: none yet)
    interval: int = 0
    #: the store ledger's view (:meth:`QuotaBook.settle`): the share last sent to Envoy, the
    #: slice the store holds for this stream, and the units no holder holds there
    sent: Share = NOTHING
    granted: Share = NOTHING
    free: Share = NOTHING
    #: the demand the bucket's other holders (every replica's streams) reported, scaled
    others: int = 0
    #: the store's cooling (:meth:`QuotaBook._store_ask`): the slices last asked without it,
    #: the larger ones kept while released burst cools, and until when (inf: no spare fill)
    asked: Share = NOTHING
    cooling: Share = NOTHING
    cool_until: float = 0.0
    #: coalesced entries (:data:`COALESCE_PART`) not yet settled: requests allowed and
    #: denied, seconds
    pending_allowed: int = 0
    pending_denied: int = 0
    pending_elapsed: float = 0.0
    #: a shedder's bucket: the blanket rule last sent (``DENY_ALL``/``ALLOW_ALL``)
    rule: str = ""


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


#: a store slice outlives the assignment it backs by this many report intervals (the answer's
#: way to Envoy: Envoy counts the assignment's TTL from when it reads it)
SLICE_MARGIN_REPORTS = 1
#: the demand ledger's units: thousandths of a request per second, at most this per holder
#: (its total is so large that it never caps a holder: it only sums what the others report)
DEMAND_SCALE = 1000
MAX_DEMAND = 10**8
DEMAND_TOTAL = 10**15


@dataclass(frozen=True, slots=True)
class Granted:
    """A store ledger's answer for one (bucket, stream): the slices it holds, the units of
    the limit no holder holds, and the demand the other holders reported (scaled)."""

    share: Share
    free: Share
    others: int
    #: the units the ledger holds past the limit after the call (a lowered limit, until the
    #: slices taken under the old one are renewed)
    over: Share = NOTHING


#: (bucket, stream) holds settled in one store call (one report's, up to this many)
MAX_HOLDS_PER_CALL = 128
#: the ledger's marker (:attr:`~extauthz.store.keys.Keys.quota_marker`, docs/rlqs.md "A store
#: that loses its data"): each replica holds one unit under its name, renewed by every store
#: call for this long (bounded: a replica quiet for longer finds its marker gone and freezes
#: once, which costs early refusal, never over-admission)
MARKER_TTL = 86400.0
#: the marker's total (never binds: its slices are only summed) and the reset flag's units
#: (held under RESET_HOLDER by a replica that found its marker gone, until every assignment
#: sent before the loss has run out: the other replicas read it in their next call)
MARKER_TOTAL = 1 << 50
RESET_UNITS = 1 << 32
RESET_HOLDER = "~reset"
#: a holder that never holds anything: its slice op reads every live slice of the marker
PROBE_HOLDER = "~probe"


@dataclass(frozen=True, slots=True)
class Marked:
    """What a store call's marker ops read (on the state before the call's commits)."""

    #: this replica's marker was gone though it had written it: the store lost the ledger
    lost: bool
    #: a reset flag was there (some replica found the ledger lost), or ``lost``
    reset: bool
    #: this replica's first call found no replica's marker: a new store, or one that lost its
    #: data whose other replicas have not called since (they find it at their next call)
    fresh: bool = False


@dataclass(frozen=True, slots=True)
class Hold:
    """One (bucket, stream)'s slices to ask of the store (:meth:`StoreLedger.hold`)."""

    bucket: BucketKey
    sid: int
    want: Share
    total: Share
    ttl: float
    demand: int = 0
    cool: float = 0.0


def fair_cap(total: Share, mine: int, others: int) -> Share:
    """The most a holder whose demand is ``mine`` may hold of ``total`` when the others'
    demand sums to ``others`` (both :data:`DEMAND_SCALE`-d): its part of the demand, each
    holder weighted one request per second more (a quiet holder keeps some), rounded down.
    A holder over it shrinks at its next report; the units go to the others."""
    floor = DEMAND_SCALE
    part = (mine + floor) / (mine + others + floor)
    return Share(math.floor(total.fill * part + 1e-9), math.floor(total.burst * part + 1e-9))


class StoreLedger:
    """The ledger across replicas (docs/rlqs.md, "The ledger in the store"): per (bucket,
    stream) a slice of the limiter's whole tokens per fill interval and one of its burst,
    each a :class:`~extauthz.store.base.SliceOp` on the bucket's two ledger keys
    (:meth:`~extauthz.store.keys.Keys.quota_ledger`), taken in one atomic store call under
    a TTL. A holder is ``<replica>.<stream id>``, the replica's name drawn at start: a
    restarted replica's streams are new holders, and the slices its predecessor's streams
    hold stay counted until their TTL (as long as the Envoys may enforce what they got)."""

    def __init__(self, store: Store, keys: Keys, *, replica: str | None = None) -> None:
        self.store = store
        self.keys = keys
        self.replica = replica if replica is not None else secrets.token_hex(6)
        if not self.replica or " " in self.replica:
            raise ValueError("a ledger replica name is not empty and has no space")
        #: store calls that failed (their actions were not sent)
        self.failures = 0
        #: the store calls answered since the last failure (0: failing now)
        self.healthy = True
        #: this replica's marker was written once (a replica's first call finding no
        #: marker of its own is a loss only when no other replica's is there either)
        self.marked = False

    def holder(self, sid: int) -> str:
        return f"{self.replica}.{sid}"

    def ops(self, bucket: BucketKey, sid: int, want: Share, total: Share, ttl: float,
            demand: int, cool: float = 0.0) -> list[SliceOp]:
        """The three slices ``sid`` asks of ``bucket``'s ledger: of the fill, of the burst
        (both ``cool`` seconds past ``ttl``: :func:`cool_tail`), and its demand (on a ledger
        whose total never binds: the others' sum comes back)."""
        limiter = dict(bucket).get(LIMITER_KEY, "")
        digest = hashlib.sha256(repr(bucket).encode()).hexdigest()[:24]
        holder = self.holder(sid)
        held_for = ttl + cool
        return [SliceOp(self.keys.quota_ledger(limiter, digest, "fill"), total.fill, held_for, holder, want.fill),
                SliceOp(self.keys.quota_ledger(limiter, digest, "burst"), total.burst, held_for, holder,
                        want.burst),
                SliceOp(self.keys.quota_ledger(limiter, digest, "demand"), DEMAND_TOTAL, ttl, holder,
                        min(MAX_DEMAND, max(0, demand)))]

    async def hold(self, bucket: BucketKey, sid: int, want: Share, total: Share, ttl: float,
                   demand: int = 0, cool: float = 0.0) -> Granted:
        """Set ``sid``'s slices of ``bucket`` to ``want``, or what is left of ``total`` when
        less (:func:`~extauthz.store.algorithms.slice_top`; ``NOTHING`` and demand 0 give
        them back), and its demand, in one atomic call; the fill and burst slices are held
        ``cool`` seconds past ``ttl``. Raises what the store raises."""
        (answer,) = await self.hold_many([Hold(bucket, sid, want, total, ttl, demand, cool)])
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def hold_many(self, holds: Sequence[Hold]) -> list[Granted | BaseException]:
        """:meth:`hold_marked` without the marker."""
        return (await self._hold(holds, marker=False))[0]

    async def hold_marked(self, holds: Sequence[Hold]) -> tuple[list[Granted | BaseException], Marked | None]:
        """:meth:`hold_many` with the ledger's marker read and renewed in the same store call
        (two ``SliceOp`` on :attr:`~extauthz.store.keys.Keys.quota_marker` beside the first
        holds: one store call still; on Redis Cluster its own call, at once): what they found
        (None: that call failed, or no holds)."""
        return await self._hold(holds, marker=True)

    def marker_ops(self) -> list[SliceOp]:
        """A probe (a holder that holds nothing: the answer gives every live slice's units)
        and this replica's marker renewed (the answer gives the others')."""
        key = self.keys.quota_marker
        return [SliceOp(key, MARKER_TOTAL, MARKER_TTL, PROBE_HOLDER, 0),
                SliceOp(key, MARKER_TOTAL, MARKER_TTL, self.replica, 1)]

    def marked_by(self, probe: OpResult, renew: OpResult) -> Marked:
        """Decode the marker ops' answers (:meth:`marker_ops`): this replica's own marker was
        there iff the probe counted one unit more than the renewal's others."""
        everyone = MARKER_TOTAL - int(probe.remaining)
        others = MARKER_TOTAL - int(renew.remaining) - max(0, int(renew.extra))
        flagged = everyone >= RESET_UNITS
        gone = everyone - others < 1
        lost = gone and self.marked
        fresh = gone and not self.marked and others % RESET_UNITS == 0
        if renew.extra >= 1:
            self.marked = True
        return Marked(lost, flagged or lost, fresh)

    async def flag_reset(self, seconds: float) -> None:
        """Hold the reset flag for ``seconds`` (bounded: the assignments' TTL and cooling):
        every replica's next call reads it and grows no share meanwhile. Raises what the
        store raises."""
        await self.store.check([SliceOp(self.keys.quota_marker, MARKER_TOTAL, seconds, RESET_HOLDER,
                                        RESET_UNITS)], "")

    async def _hold(self, holds: Sequence[Hold], *, marker: bool
                    ) -> tuple[list[Granted | BaseException], Marked | None]:
        """:meth:`hold` for many (bucket, stream)s: one store call per
        :data:`MAX_HOLDS_PER_CALL` of them (their ops in one ``check``, each bucket's three
        atomic as in :meth:`hold`), the calls at once; a call that fails fails its holds
        (the exception in their place). On Redis Cluster each hold is its own call: a
        check fails whole when one of its hash tags' masters fails (and the store runs one
        script call per hash tag all the same), so a dead master fails only the holds of
        its own buckets, not every bucket of the report, whose Envoys would go DENY_ALL at
        their assignments' TTL while their masters answer.

        Two holds of one bucket (two streams of this replica) never share a call: a check
        evaluates every op on the state before any of its commits, so both would take the
        same free units. The second goes in a later round, after the first is answered."""
        rounds: list[list[int]] = []
        seen: dict[BucketKey, int] = {}
        for n, h in enumerate(holds):
            k = seen[h.bucket] = seen.get(h.bucket, -1) + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(n)
        size = 1 if self.store.per_master else MAX_HOLDS_PER_CALL
        out: list[Granted | BaseException | None] = [None] * len(holds)
        marked: Marked | None = None
        for r, members in enumerate(rounds):
            chunks = [members[i:i + size] for i in range(0, len(members), size)]
            calls = [[op for n in chunk for op in self._ops_of(holds[n])] for chunk in chunks]
            mark = marker and r == 0
            if mark and self.store.per_master:  # its own call (its own master), at once
                chunks.append([])
                calls.append(self.marker_ops())
            elif mark:  # beside the first chunk's holds: the same store call
                calls[0] = calls[0] + self.marker_ops()
            results = await asyncio.gather(*(self.store.check(ops, "") for ops in calls), return_exceptions=True)
            for c, (chunk, result) in enumerate(zip(chunks, results, strict=True)):
                if isinstance(result, BaseException):
                    if not isinstance(result, Exception):
                        raise result
                    for n in chunk:
                        out[n] = result
                    continue
                if mark and c == (len(chunks) - 1 if self.store.per_master else 0):
                    marked = self.marked_by(*result.results[-2:])
                for j, n in enumerate(chunk):
                    fill, burst, asked = result.results[3 * j:3 * j + 3]
                    others = max(0, DEMAND_TOTAL - int(asked.remaining) - max(0, int(asked.extra)))
                    out[n] = Granted(_granted(fill, burst), Share(int(fill.remaining), int(burst.remaining)), others,
                                     Share(max(0, int(fill.retry_after)), max(0, int(burst.retry_after))))
        return [answer for answer in out if answer is not None], marked

    def _ops_of(self, h: Hold) -> list[SliceOp]:
        return self.ops(h.bucket, h.sid, h.want, h.total, h.ttl, h.demand, h.cool)

    def status(self) -> dict[str, object]:
        return {"replica": self.replica, "failures": self.failures, "healthy": self.healthy}


def cool_tail(slices: Share, interval: int) -> float:
    """How long a holder's fill and burst slices are held past the TTL of the assignment
    they back: the time their own fill takes to refill their burst. Its Envoy enforces
    nothing once the assignment expires, and the fill held meanwhile is no one else's, so
    the limiter's own bucket refills the burst that Envoy may have spent before another
    replica's Envoy can start a bucket full with it (0: no fill held, no Envoy has tokens
    from these slices)."""
    return slices.burst * interval / slices.fill if slices.fill > 0 else 0.0


def _granted(fill: OpResult, burst: OpResult) -> Share:
    return Share(max(0, int(fill.extra)), max(0, int(burst.extra)))


class QuotaBook:
    """This replica's streams, their buckets and the ledger of shares (one per server).

    ``limits()`` gives the limiters served in Envoy by name (read at every report: a reload
    takes effect at the next report; a lowered limit shrinks shares at once and grows none
    until the ledger is under it)."""

    def __init__(self, limits: Callable[[], Mapping[str, QuotaLimit]], *, clock: Clock = SYSTEM_CLOCK,
                 report_interval: float = REPORT_INTERVAL, max_streams: int = MAX_STREAMS,
                 max_buckets: int = MAX_BUCKETS_PER_STREAM, max_holds: int = MAX_HOLDS,
                 salt: bytes = b"", confirm_on_write: bool = False, ledger: StoreLedger | None = None,
                 sheds: Callable[[], Mapping[str, Collection[str]]] = dict,
                 classification: Callable[[], str] = str, min_report_gap: float | None = None) -> None:
        self.limits = limits
        #: the shedders pushed to Envoy (``envoy_deny_all``, active) by name, each with the
        #: tiers it refuses whole now (read at every report of a shedder's bucket)
        self.sheds = sheds
        #: :func:`classification_id` of the policy in force (a shedder's bucket carrying
        #: another one is never denied)
        self.classification = classification
        #: a bucket's entry sooner than this after the stream's last one settled for it is
        #: coalesced (default: :data:`COALESCE_PART` of a report interval; 0: never)
        self.min_report_gap = report_interval * COALESCE_PART if min_report_gap is None else min_report_gap
        if not (math.isfinite(self.min_report_gap) and 0 <= self.min_report_gap <= report_interval):
            raise ValueError("min_report_gap is between 0 and the report interval")
        #: the ledger across replicas beneath this replica's (None: this replica's only)
        self.ledger = ledger
        #: a shrink's confirmation waits from when it was written (:meth:`written`, the
        #: server's adapter) rather than from when it was decided: an answer a stream has not
        #: taken (a peer not reading, a stalled connection) never counts as applied
        self.confirm_on_write = confirm_on_write
        #: the identity salt: /status hashes bucket id values as identities are (keyed)
        self.salt = salt
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
        #: per bucket, burst tokens released from the ledger and not yet known refilled
        #: (:meth:`_cool`): [tokens, when settled, fill no hold had then]
        self.cooling: dict[BucketKey, list[float]] = {}
        #: buckets no stream holds that still cool, by when they are done (a heap)
        self._cooled: list[tuple[float, BucketKey]] = []
        #: counters for /metrics
        self.reports = 0
        #: tokens this replica granted past the limit, as its ledger and the store prove
        #: them (a share grown while the shares held sum past the limit): 0 by construction
        self.overadmission = 0
        #: report entries allowing more than the share they were sent could (self-reported:
        #: an Envoy not enforcing what it got, or a peer lying; one per entry, never requests)
        self.reported_excess = 0
        #: report entries coalesced (:data:`COALESCE_PART`)
        self.coalesced = 0
        self.refused: dict[str, int] = {}
        #: DENY_ALL answers sent to shedders' tier buckets
        self.shed_denials = 0
        #: the store's ledger found lost (:meth:`settle`: this replica's marker gone), and
        #: until when (monotonic) no share grows: every assignment sent before the loss has
        #: run out and cooled by then; ``_flagged``: the last marker read found a reset flag
        self.ledger_resets = 0
        self.frozen_until = 0.0
        self._reset_until = 0.0
        self._flagged = False
        #: until when a first call's markerless store is only suspect (:meth:`settle`): a
        #: stream's first report of a bucket with time elapsed (an Envoy that held it before,
        #: maybe under an assignment the lost ledger backed; ``_moved``) makes it a loss
        self._fresh_until = 0.0
        self._moved = False

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
        limits: Mapping[str, QuotaLimit] | None = None
        for stream in [s for s in self.streams.values() if s.gone_at and now >= s.gone_at]:
            del self.streams[stream.id]
            limits = self.limits() if limits is None else limits
            for key, gone in stream.buckets.items():
                self._unhold(key, stream.id)
                self._cool(key, now, limits.get(dict(key).get(LIMITER_KEY, "")),
                           0 if gone.abandoned and gone.full else _held(gone).burst)
            stream.buckets.clear()
        while self._abandoned and now >= self._abandoned[0][0]:
            _, sid, key = self._abandoned.popleft()
            found = self.streams.get(sid)
            held = found.buckets.get(key) if found is not None else None
            if found is not None and held is not None and held.abandoned and now >= held.until:
                del found.buckets[key]
                self._unhold(key, sid)
                limits = self.limits() if limits is None else limits
                self._cool(key, now, limits.get(dict(key).get(LIMITER_KEY, "")),
                           0 if held.full else _held(held).burst)
        due = []
        while self._cooled and now >= self._cooled[0][0]:  # each once (a re-push is later)
            due.append(heapq.heappop(self._cooled)[1])
        for key in due:
            if key in self.cooling and key not in self.holders:
                limits = self.limits() if limits is None else limits
                self._cool(key, now, limits.get(dict(key).get(LIMITER_KEY, "")))

    def _cool(self, key: BucketKey, now: float, limit: QuotaLimit | None, released: int = 0) -> float:
        """Burst tokens released from the ledger (a shrink confirmed, a gone stream's or an
        abandoned bucket's hold) cool before another stream gets them: the Envoy that held
        them may have spent them, and a bucket Envoy grows (its ratio of tokens kept) or
        starts (full) holds tokens at once. They are known refilled only as fill that no
        hold has accrues (the limiter's bucket refills at its whole rate while the Envoys'
        buckets refill at the fill they hold): ``released`` is added, what the unheld fill
        refilled since the last call is taken off, and the tokens still cooling returned
        (settled after every change of the bucket's ledger)."""
        state = self.cooling.get(key)
        if state is None and released <= 0:  # nothing cools: nothing to settle
            return 0.0
        tokens, since, unheld = state or (0.0, now, 0.0)
        if limit is None:
            if key not in self.holders:
                self.cooling.pop(key, None)
                return 0.0
            unheld = 0.0
        else:
            tokens = max(0.0, tokens - unheld * (now - since) / limit.interval)
        tokens += released
        if tokens < 1e-6:  # a float's rest is no token
            tokens = 0.0
        holders = self.holders.get(key, ())
        if not tokens and not holders:
            self.cooling.pop(key, None)
            return 0.0
        unheld = 0.0 if limit is None else max(0, limit.total.fill - sum(
            _held(self.streams[sid].buckets[key]).fill for sid in holders))
        self.cooling[key] = [tokens, now, unheld]
        if not holders and unheld:
            heapq.heappush(self._cooled, (now + tokens * (limit.interval if limit else 1) / unheld, key))
        return tokens

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
            first = held is None
            if held is not None and not held.abandoned and now - held.reported < self.min_report_gap:
                # sooner than Envoy reports: counted, and added to the next entry settled
                # (audited, its demand and idle streak), nothing divided nor asked of the
                # store (its assignment stands)
                held.allowed += usage.allowed
                held.denied += usage.denied
                held.pending_allowed = min(MAX_REPORTED, held.pending_allowed + usage.allowed)
                held.pending_denied = min(MAX_REPORTED, held.pending_denied + usage.denied)
                held.pending_elapsed = min(float(MAX_REPORTED), held.pending_elapsed + usage.elapsed)
                self.coalesced += 1
                continue
            fresh = usage
            if held is not None and (held.pending_allowed or held.pending_denied or held.pending_elapsed):
                usage = Usage(usage.bucket, min(float(MAX_REPORTED), usage.elapsed + held.pending_elapsed),
                              min(MAX_REPORTED, usage.allowed + held.pending_allowed),
                              min(MAX_REPORTED, usage.denied + held.pending_denied))
                held.pending_allowed = held.pending_denied = 0
                held.pending_elapsed = 0.0
            if held is None:
                if usage.elapsed > 0:
                    self._moved = True  # an Envoy that held the bucket before: maybe unbacked
                held = stream.buckets[key] = Held(reported=now)
                self.holders.setdefault(key, set()).add(stream.id)
                self.holds += 1
            if not first:  # a first report's requests were allowed under an earlier stream's assignment
                self._audit(held, usage, limits.get(dict(key).get(LIMITER_KEY, "")))
            held.allowed += fresh.allowed
            held.denied += fresh.denied
            if usage.elapsed > 0:
                held.demand = (usage.allowed + usage.denied) / usage.elapsed
            idle = usage.allowed + usage.denied == 0 and usage.elapsed > 0
            held.idle, held.idle_for = (held.idle + 1, held.idle_for + usage.elapsed) if idle else (0, 0.0)
            if held.abandoned:  # reported again: Envoy has the bucket (again)
                if usage.elapsed == 0 and held.full:  # a new bucket: the full one was dropped
                    held.ledger = held.share = NOTHING
                    held.until = 0.0
                held.abandoned, held.full, held.idle, held.idle_for = False, False, 0, 0.0
            if held.until and now >= held.until:  # a report sent after the shrink arrived
                released = _held(held).burst - held.share.burst
                held.ledger, held.until = held.share, 0.0
                self._cool(key, now, limits.get(dict(key).get(LIMITER_KEY, "")), released)
            held.reported = now
            if held.idle >= IDLE_REPORTS:
                # Envoy enforces its last assignment until the abandon reaches it (or the
                # assignment's TTL passes, if it never does): held until then, shared by none
                last = limits.get(dict(key).get(LIMITER_KEY, ""))
                slowest = min(held.ledger.fill, held.share.fill)
                held.full = last is not None and slowest > 0 and (
                    _held(held).burst * last.interval / slowest <= held.idle_for)
                held.ledger, held.share = _held(held), NOTHING
                held.until, held.abandoned = now + self.ttl, True
                self._abandoned.append((held.until, stream.id, key))
                mine.append(Action(key, None))
                continue
            if SHEDDER_KEY in (entries := dict(key)) and LIMITER_KEY not in entries:
                mine.append(self._shed(key, entries, held))
                continue
            limit = limits.get(entries.get(LIMITER_KEY, ""))
            if limit is None:
                mine.append(Action(key, NOTHING, ttl=self.ttl, deny=True))
                continue
            self._assign(key, limit, now, out)
        return {sid: actions for sid, actions in out.items() if actions}

    def _shed(self, key: BucketKey, entries: Mapping[str, str], held: Held) -> Action:
        """A shedder's tier bucket: DENY_ALL while the shedder (pushed to Envoy, active)
        refuses the tier whole, else ALLOW_ALL; never DENY_ALL for critical traffic, for
        a shedder the policy in force does not push (removed, switched off: fail open, as
        the check's shedder does), nor to matchers rendered from another classification
        (:func:`classification_id`). Its TTL is the assignments': a server gone for longer
        lets Envoy's ``expired_assignment_behavior`` (ALLOW_ALL) take it back."""
        tiers = self.sheds().get(entries[SHEDDER_KEY])
        tier = entries.get(TIER_KEY, "")
        deny = (tiers is not None and tier != Tier.CRITICAL.value and tier in tiers
                and entries.get(CLASSIFICATION_KEY) == self.classification())
        held.rule = "DENY_ALL" if deny else "ALLOW_ALL"
        self.shed_denials += deny
        return Action(key, NOTHING, ttl=self.ttl, deny=deny, allow=not deny)

    def _audit(self, held: Held, usage: Usage, limit: QuotaLimit | None) -> None:
        """An entry allowing more than the stream's share (the larger of what it held) could
        counts once in :attr:`reported_excess` (with the entries coalesced into it)."""
        allowed, elapsed = usage.allowed, usage.elapsed
        if limit is None or elapsed <= 0:
            return
        share = Share(max(held.share.fill, held.ledger.fill), max(held.share.burst, held.ledger.burst))
        # Envoy 1.40 rounds time_elapsed down to whole seconds (4 s for ~4.98 s): up to 1 s more
        bound = share.fill * (elapsed + ELAPSED_ROUNDING) / limit.interval + share.burst
        if allowed > bound + 1e-9:
            self.reported_excess += 1

    def _assign(self, key: BucketKey, limit: QuotaLimit, now: float, out: dict[int, list[Action]]) -> None:
        sids = sorted(self.holders.get(key, ()))
        holders = {sid: self.streams[sid].buckets[key] for sid in sids}
        live = {sid: h.demand for sid, h in holders.items() if not (self.streams[sid].gone_at or h.abandoned)}
        whole, interval = limit.total, limit.interval
        if len(holders) == 1 and live and not holders[sids[0]].until and key not in self.cooling:
            # what divide gives one stream alone, nothing cooling nor waiting: the whole limit
            shares = {sids[0]: whole if whole.fill and whole.burst else NOTHING}
        else:
            # while released tokens cool, no burst grows past what they leave and no fill
            # grows (the unheld fill is what cools them)
            cooling = self._cool(key, now, limit)
            reserve = Share(whole.fill, math.ceil(cooling - 1e-9)) if cooling > 1e-9 else NOTHING
            # a closed or abandoned hold keeps its last share, gets none
            shares = divide(whole, live, {sid: _held(h) for sid, h in holders.items()},
                            {sid: h.share for sid, h in holders.items()}, reserve)
        confirm_after = math.inf if self.confirm_on_write else now + self.report_interval / 2
        for sid, share in shares.items():
            h = holders[sid]
            if share != NOTHING and share == h.share and h.interval and h.interval != interval:
                # a reload changed the interval only: Envoy 1.40 ignores a change of a token
                # bucket's fill_interval alone (it compares only the nanoseconds) and would
                # keep filling at the old one: the bucket goes (DENY_ALL) and is granted anew
                share = NOTHING
            changed = share != h.share
            before = _held(h)
            if share.fill < h.share.fill or share.burst < h.share.burst:
                h.ledger, h.until = _max(h.ledger, h.share), confirm_after
            elif not h.until:
                h.ledger = share
            else:
                h.ledger = _max(h.ledger, share)
            h.share = share
            if share != NOTHING:
                h.interval = interval
            if changed or sid in out:  # the reporting stream gets every bucket (TTL refreshed)
                out.setdefault(sid, []).append(Action(key, share, interval, self.ttl))
            grown = _past(_held(h), before)
            if grown != NOTHING:
                # what the ledger proves: a hold grown while the holds sum past the limit
                held_sum = Share(sum(_held(o).fill for o in holders.values()),
                                 sum(_held(o).burst for o in holders.values()))
                self.overadmission += _sum(_min(grown, _past(held_sum, whole)))
        self._cool(key, now, limit)  # the unheld fill from now on

    def written(self, stream: Stream, shares: Iterable[tuple[BucketKey, Share]]) -> None:
        """Answers were written to ``stream``, each a bucket and the share it carried: a
        waiting shrink to the share the bucket now has is confirmed by a report arriving half
        a report interval from now (``confirm_on_write``). An older answer (another share)
        confirms nothing: one stream's answers arrive in order."""
        confirm_after = self.clock.monotonic() + self.report_interval / 2
        for key, share in shares:
            held = stream.buckets.get(key)
            if held is not None and held.until == math.inf and not held.abandoned and share == held.share:
                held.until = confirm_after

    # -- the store ledger
    async def settle(self, out: dict[int, list[Action]]) -> dict[int, list[Action]]:
        """The actions of :meth:`report` as far as the store's ledger backs them: each
        assignment's slices are asked of the store (one call for them all,
        :meth:`StoreLedger.hold_many`) (the held size: a shrunk share's old
        size until it is confirmed) and the share sent is at most what the store granted; an
        abandoned bucket's slices go back. An assignment the store did not answer is not sent
        (its Envoy keeps its last assignment, which its slices back until their TTL, then
        applies ``expired_assignment_behavior``: DENY_ALL). Without a ledger: ``out``."""
        ledger = self.ledger
        if ledger is None:
            return out
        limits = self.limits()
        now = self.clock.monotonic()
        ttl = self.ttl + SLICE_MARGIN_REPORTS * self.report_interval
        frozen = now < self.frozen_until  # (a flag read last time: checked on this call's answer)
        jobs: list[tuple[int, int, Held | None]] = []
        holds: list[Hold] = []
        dropped: set[tuple[int, int]] = set()
        out = {sid: list(actions) for sid, actions in out.items()}
        for sid, actions in out.items():
            stream = self.streams.get(sid)
            for i, action in enumerate(actions):
                if action.deny or action.allow:  # a blanket rule holds no tokens
                    continue
                if action.share is None:  # abandoned: its slices stay until their TTL (Envoy
                    continue  # enforces the last assignment until the abandon reaches it)
                held = stream.buckets.get(action.bucket) if stream is not None else None
                limit = limits.get(dict(action.bucket).get(LIMITER_KEY, ""))
                total = limit.total if limit is not None else NOTHING
                if held is None:  # its stream is gone: nothing backs it, nothing is sent
                    dropped.add((sid, i))
                    continue
                # at most its part of the demand across every holder (the others' as last
                # answered); the store keeps what its Envoy may hold until it confirms a shrink
                demand = min(MAX_DEMAND, round(held.demand * DEMAND_SCALE))
                share = _min(action.share, fair_cap(total, demand, held.others))
                if now < held.cool_until and share.burst > held.sent.burst:
                    # no burst grows while its own release cools (a bucket Envoy grows or
                    # starts anew holds tokens at once: the released ones, maybe spent)
                    share = Share(share.fill, held.sent.burst)
                if frozen:  # the store lost the ledger: renewed at most at its size
                    share = _min(share, held.sent)
                if not (share.fill and share.burst):  # Envoy's token bucket needs both
                    share = NOTHING
                out[sid][i] = Action(action.bucket, share, action.interval, action.ttl)
                # (a shrink not yet confirmed: the ledger's size; else what was sent last)
                keep = _max(held.ledger, held.sent) if held.until else held.sent
                ask = self._store_ask(held, _max(keep, share), limit, now)
                jobs.append((sid, i, held))
                holds.append(Hold(action.bucket, sid, ask, total, ttl, demand,
                                  cool_tail(ask, limit.interval) if limit is not None else 0.0))
        answers, marked = await ledger.hold_marked(holds) if holds else ([], None)
        now = self.clock.monotonic()
        if marked is not None:
            self._flagged = marked.reset
            if marked.fresh:  # grow nothing until the other replicas' next calls (each within
                # a report interval, plus its answer) have read their markers and flagged a loss
                self._fresh_until = now + 2 * self.report_interval
                self.frozen_until = max(self.frozen_until, self._fresh_until)
            if marked.lost or (self._moved and now <= self._fresh_until):
                self._fresh_until = 0.0
                await self._reset(limits, ttl, now)
        # no marker read (its call failed): as if reset (no share grows on this answer)
        frozen = marked is None or marked.reset or now < self.frozen_until
        settled = out
        failed = 0
        retail: list[Hold] = []
        for (sid, i, held), hold, answer in zip(jobs, holds, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer
                failed += 1
                dropped.add((sid, i))
                if held is not None:  # Envoy keeps what it was sent last
                    held.share = held.sent
                continue
            if held is None:
                continue
            action = settled[sid][i]
            assert action.share is not None
            share = _min(action.share, answer.share)
            if frozen:  # no share grows past what its Envoy holds now
                share = _min(share, held.sent)
            if not (share.fill and share.burst):  # sent as DENY_ALL: Envoy holds no tokens
                share = NOTHING
            # what the store proves: a share grown while the slices sum past the limit
            self.overadmission += _sum(_min(_past(share, held.sent), answer.over))
            if share.fill < held.sent.fill or share.burst < held.sent.burst:  # a shrink: held until confirmed
                confirm_after = math.inf if self.confirm_on_write else now + self.report_interval / 2
                held.ledger, held.until = _max(held.ledger, held.sent), max(held.until, confirm_after)
            elif not held.until:
                held.ledger = share
            held.share, held.sent, held.granted, held.free, held.others = (share, share, answer.share, answer.free,
                                                                           answer.others)
            settled[sid][i] = Action(action.bucket, share, action.interval, action.ttl)
            if hold.cool and (tail := cool_tail(answer.share, action.interval)) > hold.cool + 1e-9:
                # the store cut the fill more than the burst: the tail asked was timed on fill
                # this holder does not hold; held again for the tail of what it does hold
                retail.append(Hold(hold.bucket, hold.sid, answer.share, hold.total, hold.ttl, hold.demand, tail))
        if retail:  # (no other holder can take the slices granted meanwhile; a failure
            # leaves the shorter tail, counted)
            ledger.failures += sum(isinstance(a, BaseException) for a in await ledger.hold_many(retail))
        if failed:
            ledger.failures += failed
            if ledger.healthy:
                log.warning("the quota ledger's store did not answer: %d assignments not sent (each Envoy "
                            "keeps its last one until its TTL, then DENY_ALL)", failed,
                            extra={"fields": {"event": "quota_ledger_failed"}})
            ledger.healthy = False
        elif jobs:
            ledger.healthy = True
        return {sid: kept for sid, actions in settled.items()
                if (kept := [a for i, a in enumerate(actions) if (sid, i) not in dropped])}

    async def _reset(self, limits: Mapping[str, QuotaLimit], ttl: float, now: float) -> None:
        """The store lost the ledger (this replica's marker gone): the Envoys still enforce
        what they were sent, unbacked. No share grows until every assignment sent before the
        loss has run out (``ttl``: the slices' TTL, which covers the answers' way) and the
        tokens those Envoys spent have refilled in the limiter's own bucket (a holder's fill
        is at least 1 per interval: ``burst x interval``, the longest :func:`cool_tail`); the
        reset flag tells the other replicas for as long."""
        freeze = ttl + max((cool_tail(Share(1, limit.total.burst), limit.interval) for limit in limits.values()),
                           default=0.0)
        if now >= self._reset_until:  # a new loss (not one found again by a concurrent call)
            self.ledger_resets += 1
            log.warning("the quota ledger's store lost its data (this replica's marker was gone): no share "
                        "grows for %.0f s", freeze, extra={"fields": {"event": "quota_ledger_reset"}})
        self._reset_until = max(self._reset_until, now + freeze)
        self.frozen_until = max(self.frozen_until, self._reset_until)
        self._flagged = True
        assert self.ledger is not None
        try:
            await self.ledger.flag_reset(freeze)
        except Exception:  # the others find their own markers gone all the same
            self.ledger.failures += 1

    @staticmethod
    def _store_ask(held: Held, base: Share, limit: QuotaLimit | None, now: float) -> Share:
        """The slices to ask of the store: ``base`` (what its Envoy may enforce), or more
        while burst this holder released cools. Envoy grows a bucket with its ratio of tokens
        kept and starts a new one full, so burst released to the store at once could come
        back in another replica's Envoy right after this one's spent it (docs/rlqs.md,
        "Cooling across replicas"). So a release of burst keeps the larger slices asked
        before it (``cooling``) for the time the fill they hold and the Envoy no longer
        uses (``cooling.fill - base.fill``, which no other holder can take meanwhile) takes
        to refill the released burst; with no such fill, until there is some. A cooling
        that the holder's own fill grows into is timed again from now (less of it spare)."""
        if held.cool_until and now >= held.cool_until:
            held.cooling, held.cool_until = NOTHING, 0.0
        last, held.asked = held.asked, base
        if limit is None:
            return _max(base, held.cooling) if held.cool_until else base
        if base.burst < last.burst:  # burst released: it cools before the store frees it
            held.cooling = _max(held.cooling, last)
        elif not held.cool_until or (base.fill <= last.fill and held.cool_until < math.inf):
            return _max(base, held.cooling) if held.cool_until else base
        # the spare fill is what the store holds for it (it may have granted less than asked)
        held_fill = min(held.cooling.fill, held.granted.fill) if held.granted != NOTHING else held.cooling.fill
        spare, left = held_fill - base.fill, held.cooling.burst - base.burst
        if left <= 0:  # grown back past what cooled: nothing left to cool
            held.cooling, held.cool_until = NOTHING, 0.0
            return base
        until = now + left * limit.interval / spare if spare > 0 else math.inf
        held.cool_until = until if held.cool_until == math.inf else max(held.cool_until, until)
        return _max(base, held.cooling)

    # -- status
    def status(self) -> dict[str, object]:
        def sent(h: Held) -> Share:
            """The share sent to Envoy: with a store ledger, the last one it settled (a
            report's division waiting for its store call is not sent yet)."""
            return h.sent if self.ledger is not None else h.share

        return {
            "streams": [{
                "id": s.id, "peer": s.peer, "domain": s.domain, "closed": bool(s.gone_at),
                "buckets": [{"bucket": shown(k, self.salt), "fill": sent(h).fill, "burst": sent(h).burst,
                             "held": {"fill": h.ledger.fill, "burst": h.ledger.burst},
                             "store": {"fill": h.granted.fill, "burst": h.granted.burst,
                                       "free": {"fill": h.free.fill, "burst": h.free.burst},
                                       "others_demand": round(h.others / DEMAND_SCALE, 3)},
                             "demand": round(h.demand, 3), "allowed": h.allowed, "denied": h.denied,
                             **({"rule": h.rule} if h.rule else {})}
                            for k, h in s.buckets.items()],
            } for s in self.streams.values()],
            "reports": self.reports, "overadmission": self.overadmission,
            "reported_excess": self.reported_excess, "coalesced": self.coalesced, "refused": dict(self.refused),
            "shed_denials": self.shed_denials,
            "ledger": {**self.ledger.status(), "resets": self.ledger_resets,
                       "frozen_for": round(max(0.0, self.frozen_until - self.clock.monotonic()), 3),
                       "flagged": self._flagged} if self.ledger is not None else None,
        }


#: the bucket id entries /status shows as they are (the generator's, never a credential);
#: every other entry's value is shown hashed
SHOWN_RAW = frozenset({LIMITER_KEY, "source_ip", "method", SHEDDER_KEY, TIER_KEY, CLASSIFICATION_KEY})


def shown(bucket: BucketKey, salt: bytes = b"") -> dict[str, str]:
    """A bucket id as /status shows it: the limiter, the client address and the method as
    they are; any other value (a header's, or an entry of a hand-written Envoy config such
    as ``api_key``: it may be a credential) hashed as identities are
    (:func:`~extauthz.classify.hash_identity`, keyed with the identity salt, the entry's
    name as the source): an unkeyed digest of a short key is found by trying keys."""
    return {k: (v if k in SHOWN_RAW else hash_identity(v, k, salt)) for k, v in bucket}


def _held(h: Held) -> Share:
    """What the ledger counts for a hold: the share sent, or the larger one a shrink of it
    waits to be confirmed for."""
    return _max(h.ledger, h.share)


def _max(a: Share, b: Share) -> Share:
    return Share(max(a.fill, b.fill), max(a.burst, b.burst))


def _min(a: Share, b: Share) -> Share:
    return Share(min(a.fill, b.fill), min(a.burst, b.burst))


def _past(a: Share, b: Share) -> Share:
    """What ``a`` holds past ``b``, in each number (0 where it does not)."""
    return Share(max(0, a.fill - b.fill), max(0, a.burst - b.burst))


def _sum(a: Share) -> int:
    return a.fill + a.burst
