"""Quota limiter: at most ``limit`` requests per calendar ``period`` (UTC), per key.

Windows are calendar windows in UTC: a ``second``, ``minute``, ``hour`` or ``day`` starts
on the second, minute, hour or midnight; a ``week`` on Monday 00:00; a ``month`` on its first
day; a ``year`` on January 1st. Each
window is its own store key (named by the window's start), a count that the store adds
``cost`` to while it stays within ``limit`` (``store.algorithms.count_admits``; the same
rule on both stores) and that expires at the window's end plus :data:`TTL_MARGIN`, so a
count survives a restart of the server.

``consistency: batched``: the window's count is asked in grants of ``batch`` requests
(default :func:`default_quota_batch`, 1% of the limit), added to the count at once and
spent locally (:mod:`.grants`, ``store.algorithms.quota_grant_size``); a request the grant
covers needs no store call, and unspent units go back to the count within
``sync_interval``. A grant belongs to its window: one taken in a window is never spent in
the next. The window is read from the limiter's clock (wall
time): replicas whose clocks disagree by a few seconds disagree that long about where a
window ends. Answers 429 with ``Retry-After`` = seconds to the window's end. ``limit`` is
per customer: the limiter's own, its plan's (``plans``) or a live override's (``limit=``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.verdict import Limits, Outcome, Quota, Verdict
from ..policy.schema import QuotaSpec
from ..store.base import CountOp, Op, OpResult, QuotaGrantOp, QuotaReturnOp, Store
from ..store.keys import Keys
from .base import BY_IDENTITY, KeyOf, PerCustomer, denied_outcome, override_limit
from .grants import GrantTable, Numbers

#: seconds a window's count outlives the window (clock skew between replicas, late answers).
TTL_MARGIN = 3600
_DAY = 86400
#: 1970-01-01 (day 0) was a Thursday: Monday is 3 days before it.
_THURSDAY = 3


def calendar_window(period: str, wall: float) -> tuple[int, int]:
    """The UTC calendar window holding ``wall`` (Unix seconds): (start, end), end excluded."""
    now = math.floor(wall)
    if period == "second":
        return now, now + 1
    if period == "minute":
        start = now - now % 60
        return start, start + 60
    if period == "hour":
        start = now - now % 3600
        return start, start + 3600
    day = now - now % _DAY
    if period == "day":
        return day, day + _DAY
    if period == "week":
        start = day - ((day // _DAY + _THURSDAY) % 7) * _DAY
        return start, start + 7 * _DAY
    if period == "month":
        t = datetime.fromtimestamp(day, UTC)
        first = datetime(t.year, t.month, 1, tzinfo=UTC)
        after = datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=UTC)
        return int(first.timestamp()), int(after.timestamp())
    if period == "year":
        year = datetime.fromtimestamp(day, UTC).year
        return (int(datetime(year, 1, 1, tzinfo=UTC).timestamp()),
                int(datetime(year + 1, 1, 1, tzinfo=UTC).timestamp()))
    raise ValueError(f"unknown quota period {period!r}")


def default_quota_batch(limit: int, cost: int) -> int:
    """The documented default ``batch`` of a quota: 1% of its ``limit``, at least one
    request's ``cost`` (so ``batch x (replicas - 1)``, the early-refusal bound, is
    ``replicas - 1`` percent of the limit)."""
    return max(cost, limit // 100)


def quota_return(key: str, numbers: Numbers, amount: float) -> Op:
    """A quota's give-back (the table's ``give_back``): whole units."""
    return QuotaReturnOp(key, int(amount))


def quota_limits(limit: int) -> Limits:
    return Limits(limit=limit)


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class QuotaLimiter(PerCustomer):
    def __init__(self, spec: QuotaSpec, keys: Keys, clock: Clock = SYSTEM_CLOCK,
                 key: KeyOf = BY_IDENTITY, store: Store | None = None) -> None:
        super().__init__(spec, keys, key)
        self.limit = spec.limit
        self.period = spec.period
        self.cost = spec.cost
        self._clock = clock
        self.own = quota_limits(spec.limit)
        self.plans: dict[str, Limits] = {name: quota_limits(p.limit) for name, p in (spec.plans or {}).items()}
        self._window = (0, 0)
        #: batched grants (``consistency: batched``), else None
        self.grants: GrantTable | None = None
        self.batch = spec.batch
        self.sync_interval = spec.sync_interval
        if spec.consistency == "batched":
            self.grants = GrantTable(spec.sync_interval, clock, give_back=quota_return, store=store)
        #: the request whose cost :meth:`local` spent from a grant (its :meth:`op` is None)
        self._spent: RequestContext | None = None

    def window(self, wall: float) -> tuple[int, int]:
        """The current window, computed once per window (a month needs a calendar)."""
        start, end = self._window
        if not start <= wall < end:
            self._window = start, end = calendar_window(self.period, wall)
        return start, end

    def override(self, numbers: Mapping[str, float]) -> dict[str, Limits]:
        """An override's numbers, the same for every plan. ValueError when they do not fit."""
        limit = override_limit(numbers, "quota")
        if self.cost > limit:
            raise ValueError(f"cost ({self.cost}) is larger than limit ({limit}): no request could ever pass")
        return {"": quota_limits(limit)}

    def want(self, n: Limits) -> int:
        """Units one grant takes for a customer with numbers ``n``: ``batch`` (default
        :func:`default_quota_batch`), at least one request's cost."""
        if self.batch is None:
            return default_quota_batch(int(n.limit), self.cost)
        return max(int(self.batch), self.cost)

    def _count_key(self, ctx: RequestContext, start: int) -> str:
        return self._keys.quota(self.name, self.key.of(ctx) or ctx.identity, start)

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        if self.grants is None:
            return None
        n = self.limits(ctx)
        wall = self._clock.wall()
        start, end = self.window(wall)
        remaining = self.grants.spend(self._count_key(ctx, start), ctx.cost(self.cost), (float(n.limit),))
        if remaining is None:
            return None
        self._spent = ctx  # op() is called next, for the same request: nothing to ask
        return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=n.limit, remaining=remaining,
                       reset=end - wall, quota=Quota(limit=n.limit, window=end - start))

    def refund(self, ctx: RequestContext) -> None:
        """The request :meth:`local` admitted from a grant was refused by another limiter:
        its cost goes back to the grant (batched grants only)."""
        if self.grants is not None:
            start, _ = self.window(self._clock.wall())
            key = self._count_key(ctx, start)
            if key in self.grants:  # else the window ended meanwhile: the unit is dropped
                # (it only refuses early), never given to the new window's count
                self.grants.restore(key, float(ctx.cost(self.cost)), (float(self.limits(ctx).limit),))

    def op(self, ctx: RequestContext, enforce: bool) -> CountOp | QuotaGrantOp | None:
        if self._spent is not None:
            spent, self._spent = self._spent, None
            if spent is ctx:
                return None
        wall = self._clock.wall()
        start, end = self.window(wall)
        key = self._count_key(ctx, start)
        n = self.limits(ctx)
        ttl = math.ceil(end - wall) + TTL_MARGIN
        if self.grants is not None:
            return QuotaGrantOp(key, int(n.limit), ctx.cost(self.cost), self.want(n), ttl, end - wall,
                                enforce, int(self.grants.lend(key, (float(n.limit),))))
        return CountOp(key, n.limit, ctx.cost(self.cost), ttl, end - wall, enforce)

    def _granted(self, ctx: RequestContext, n: Limits, result: OpResult) -> OpResult:
        """A grant's answer kept in the table (``retry_after`` carries the seconds to its
        window's end: the window the grant was taken in, even when it ended meanwhile), as
        the count's answer for the request."""
        assert self.grants is not None
        end = round(self._clock.wall() + result.retry_after)
        start, _ = calendar_window(self.period, end - 1)
        key, numbers = self._count_key(ctx, start), (float(n.limit),)
        reset = result.retry_after
        if result.extra <= 0.0:  # nothing committed: the remainder lent stays here
            self.grants.restore(key, -result.extra, numbers)
        if not result.allowed:
            return OpResult(False, result.remaining, reset, reset)
        remaining = result.remaining + self.grants.held(key)
        if result.extra > 0.0:  # a grant was taken: this request spends from it
            remaining = self.grants.granted(key, result.extra, float(ctx.cost(self.cost)), result.remaining,
                                            float(self.want(n)), numbers)
        return OpResult(True, remaining, 0.0, reset)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        n = self.limits(ctx)
        if self.grants is not None:
            result = self._granted(ctx, n, result)
        end = round(self._clock.wall() + result.extra)  # the window's end (an integer)
        start, _ = calendar_window(self.period, end - 1)
        quota = Quota(limit=n.limit, window=end - start)
        if result.allowed:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=n.limit,
                           remaining=result.remaining, reset=result.extra, quota=quota)
        plan = f" (plan {ctx.plan})" if ctx.plan else ""
        return Verdict(
            self.name, self.kind, denied_outcome(enforce), limit=n.limit, remaining=result.remaining,
            retry_after=result.retry_after, reset=result.extra, reason="quota_exceeded", quota=quota,
            resets_at=float(end),
            detail=(f"Quota '{self.name}' exceeded{plan}: {n.limit} requests per {self.period} "
                    f"(UTC). The quota resets at {_utc(end)}."))
