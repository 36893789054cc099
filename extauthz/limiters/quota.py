"""Quota limiter: at most ``limit`` requests per calendar ``period`` (UTC), per key.

Windows are calendar windows in UTC: a ``minute``, ``hour`` or ``day`` starts on the
minute, hour or midnight; a ``week`` on Monday 00:00; a ``month`` on its first day. Each
window is its own store key (named by the window's start), a count that the store adds
``cost`` to while it stays within ``limit`` (``store.algorithms.count_admits``; the same
rule on both stores) and that expires at the window's end plus :data:`TTL_MARGIN`, so a
count survives a restart of the server. The window is read from the limiter's clock (wall
time): replicas whose clocks disagree by a few seconds disagree that long about where a
window ends. Answers 429 with ``Retry-After`` = seconds to the window's end. ``limit`` is
per customer: the limiter's own, its plan's (``plans``) or a live override's (``limit=``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime

from ..clock import SYSTEM_CLOCK, Clock
from ..context import RequestContext
from ..policy.schema import QuotaSpec
from ..store.base import CountOp, OpResult
from ..store.keys import Keys
from ..verdict import Limits, Outcome, Quota, Verdict
from .base import BY_IDENTITY, KeyOf, PerCustomer, denied_outcome, override_limit

#: seconds a window's count outlives the window (clock skew between replicas, late answers).
TTL_MARGIN = 3600
_DAY = 86400
#: 1970-01-01 (day 0) was a Thursday: Monday is 3 days before it.
_THURSDAY = 3


def calendar_window(period: str, wall: float) -> tuple[int, int]:
    """The UTC calendar window holding ``wall`` (Unix seconds): (start, end), end excluded."""
    now = math.floor(wall)
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
    raise ValueError(f"unknown quota period {period!r}")


def quota_limits(limit: int) -> Limits:
    return Limits(limit=limit)


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class QuotaLimiter(PerCustomer):
    def __init__(self, spec: QuotaSpec, keys: Keys, clock: Clock = SYSTEM_CLOCK,
                 key: KeyOf = BY_IDENTITY) -> None:
        super().__init__(spec, keys, key)
        self.limit = spec.limit
        self.period = spec.period
        self.cost = spec.cost
        self._clock = clock
        self.own = quota_limits(spec.limit)
        self.plans: dict[str, Limits] = {name: quota_limits(p.limit) for name, p in (spec.plans or {}).items()}
        self._window = (0, 0)

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

    def op(self, ctx: RequestContext, enforce: bool) -> CountOp:
        wall = self._clock.wall()
        start, end = self.window(wall)
        return CountOp(self._keys.quota(self.name, self.key.of(ctx) or ctx.identity, start),
                       self.limits(ctx).limit, self.cost, math.ceil(end - wall) + TTL_MARGIN,
                       end - wall, enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        n = self.limits(ctx)
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
