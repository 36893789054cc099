"""For a refused customer: the smallest numbers that would have admitted all their traffic.

The replay keeps, per identity, the start and duration of each of its requests and which
per-customer limiters (request_rate, concurrent_requests, quota counting per identity) saw
it (:class:`Timelines`). After the replay, for each limiter that refused the customer, the
customer's requests under that limiter are played again through the limiter's own rule in
:mod:`extauthz.store.algorithms` (no second copy of a rule), every request committed:

* ``request_rate``: the smallest ``burst`` at the policy's rate, and the smallest ``rate`` at
  the policy's burst (``None`` when no rate suffices: more than a burst of requests at one
  instant), by bisection over :func:`refill`, :func:`admits`, :func:`take`; a bucket starts
  full, as a customer's first request finds it;
* ``concurrent_requests``: the smallest ``limit``: one more than the most leases live
  (:func:`lease_live`) when one of its requests starts (:func:`lease_admits`); a request
  whose end is unknown holds its lease for the limiter's ``lease_ttl``, as in the replay;
* ``quota``: the smallest ``limit``: the most the customer sent in one calendar window
  (:func:`count_admits`).

The figures are for the customer's numbers (its plan's) as the candidate policy has them;
round numbers are given (a whole burst or limit, a rate rounded up to three significant
digits), each checked again with the rule. A limiter that counts per another key (client
IP, a header) shares its bucket between customers: it gets no figure here.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...core.context import RequestContext
from ...core.verdict import Decision, Limits
from ...limiters.concurrent import ConcurrentRequestsLimiter
from ...limiters.quota import QuotaLimiter, calendar_window
from ...limiters.request_rate import RequestRateLimiter
from ...policy.schema import MAX_RATE
from ...store.algorithms import admits, count_admits, lease_admits, lease_live, refill, take

#: bisection steps (a relative precision far below the rounding to three digits)
_STEPS = 60


@dataclass
class Timeline:
    """One identity's requests: start, duration (NaN: unknown) and a bit per limiter that
    saw it (the limiter's index in :attr:`Timelines.limiters`)."""

    context: RequestContext
    times: array[float] = field(default_factory=lambda: array("d"))
    durations: array[float] = field(default_factory=lambda: array("d"))
    seen: array[int] = field(default_factory=lambda: array("Q"))

    def of(self, bit: int) -> list[tuple[float, float]]:
        mask = 1 << bit
        return [(t, d) for t, d, s in zip(self.times, self.durations, self.seen, strict=True) if s & mask]


class Timelines:
    """The per-identity timelines of one lane, fed by :meth:`add` after each decision."""

    def __init__(self, limiters: Iterable[Any]) -> None:
        #: the per-customer limiters that count per identity, by bit
        self.limiters: list[RequestRateLimiter | ConcurrentRequestsLimiter | QuotaLimiter] = [
            lim for lim in limiters
            if isinstance(lim, (RequestRateLimiter, ConcurrentRequestsLimiter, QuotaLimiter))
            and lim.key.index is None][:64]
        self._bits = {lim.name: i for i, lim in enumerate(self.limiters)}
        self.by_identity: dict[str, Timeline] = {}

    def add(self, ctx: RequestContext, t: float, duration: float | None, decision: Decision) -> None:
        bits = self._bits
        seen = 0
        for v in decision.verdicts:
            bit = bits.get(v.limiter)
            if bit is not None:
                seen |= 1 << bit
        if not seen:
            return
        line = self.by_identity.get(ctx.identity)
        if line is None:
            line = self.by_identity[ctx.identity] = Timeline(ctx)
        line.times.append(t)
        line.durations.append(math.nan if duration is None else duration)
        line.seen.append(seen)

    def advice(self, identity: str, refused_by: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Limiter -> the smallest numbers that admit all of ``identity``'s requests, for the
        limiters in ``refused_by`` that count per identity."""
        line = self.by_identity.get(identity)
        out: dict[str, dict[str, Any]] = {}
        if line is None:
            return out
        for name in refused_by:
            bit = self._bits.get(name)
            if bit is None:
                continue
            lim = self.limiters[bit]
            requests = line.of(bit)
            n = lim.limits(line.context)
            if isinstance(lim, RequestRateLimiter):
                out[name] = {**bucket_advice([t for t, _ in requests], n),
                             "policy": {"rate": n.rate, "burst": n.burst}}
            elif isinstance(lim, ConcurrentRequestsLimiter):
                out[name] = {"limit": smallest_lease_limit(requests, lim.ttl), "policy": {"limit": n.limit}}
            elif isinstance(lim, QuotaLimiter):
                out[name] = {"limit": smallest_quota_limit([t for t, _ in requests], lim.cost, lim.period),
                             "policy": {"limit": n.limit}}
        return out


# -- the rules, played again ----------------------------------------------------------------


def bucket_admits_all(times: list[float], rate: float, burst: float, cost: float) -> bool:
    """Whether a bucket (``rate``, ``burst``), full at the first request, admits every
    request of ``cost`` at ``times``: the store's rule, step by step."""
    tokens, last = burst, times[0] if times else 0.0
    for t in times:
        tokens = refill(tokens, last, t, rate, burst)
        last = t
        if not admits(tokens, cost):
            return False
        tokens = take(tokens, cost)
    return True


def _smallest(ok: Callable[[float], bool], start: float, high: float, *, whole: bool = False,
              tolerance: float = 1e-4) -> float | None:
    """The smallest x in (0, high] with ``ok(x)`` (``ok`` monotone), or None: doubled from
    ``start`` until it holds, then bisected: to the exact whole number (``whole``), else
    within a relative ``tolerance``, never below the smallest."""
    low, x = 0.0, min(max(start, 1e-9), high)
    while not ok(x):
        if x >= high:
            return None
        low, x = x, min(x * 2, high)
    if whole:
        lo, hi = math.floor(low), math.ceil(x)  # ok(hi); not ok(lo) unless lo is 0
        if lo > 0 and ok(lo):
            return float(lo)
        while hi - lo > 1:
            half = (lo + hi) // 2
            lo, hi = (lo, half) if ok(half) else (half, hi)
        return float(hi)
    for _ in range(_STEPS):
        if x - low <= x * tolerance:
            break
        mid = (low + x) / 2
        if ok(mid):
            x = mid
        else:
            low = mid
    return x


def _round_up(x: float, ok: Callable[[float], bool], digits: int = 3) -> float:
    """``x`` rounded up to ``digits`` significant digits (checked with ``ok``; else ``x``)."""
    if x <= 0:
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    nice = math.ceil(x * scale - 1e-9) / scale
    return nice if ok(nice) else x


def bucket_advice(times: list[float], n: Limits) -> dict[str, Any]:
    """``{"burst": B, "rate": R}``: the smallest whole burst at the policy's rate, and the
    smallest rate at the policy's burst (None when none suffices)."""
    if not times:
        return {"burst": n.burst, "rate": n.rate}
    total = n.cost * len(times)  # a bucket this big, full at the start, admits them all
    burst = _smallest(lambda b: bucket_admits_all(times, n.rate, b, n.cost), n.burst, max(total, n.burst),
                      whole=True)
    whole = int(burst) if burst is not None else None
    rate = _smallest(lambda r: bucket_admits_all(times, r, n.burst, n.cost), n.rate, MAX_RATE)
    if rate is not None:
        rate = _round_up(rate, lambda r: bucket_admits_all(times, r, n.burst, n.cost))
    return {"burst": whole, "rate": rate}


def smallest_lease_limit(requests: list[tuple[float, float]], ttl: float) -> int:
    """One more than the most leases live when a request starts, every request holding its
    lease until its end (a NaN duration: ``ttl``)."""
    ends: list[float] = []
    limit = 1
    for t, d in sorted(requests):
        while ends and not lease_live(ends[0], t):
            heapq.heappop(ends)
        if not lease_admits(len(ends), limit):
            limit = len(ends) + 1  # the rule: live < limit
        heapq.heappush(ends, t + (ttl if math.isnan(d) else d))
    return limit


def smallest_quota_limit(times: list[float], cost: int, period: str) -> int:
    """The smallest limit under which every request's window count admits it."""
    counts: dict[int, int] = {}
    limit = cost
    for t in times:
        start, _ = calendar_window(period, t)
        count = counts.get(start, 0)
        if not count_admits(count, cost, limit):
            limit = count + cost  # the rule: count + cost <= limit
        counts[start] = count + cost
    return limit


def describe_advice(numbers: Mapping[str, Any]) -> str:
    """``burst 31 (at rate 1/s), or rate 3.59/s (at burst 5)``; ``limit 16 (the policy: 10)``."""
    policy = numbers.get("policy") or {}
    if "burst" in numbers:
        text = f"burst {numbers['burst']:g} (at rate {policy.get('rate', 0):g}/s)"
        if numbers.get("rate") is not None:
            return text + f", or rate {numbers['rate']:g}/s (at burst {policy.get('burst', 0):g})"
        return text + f"; no rate would at burst {policy.get('burst', 0):g} (more at one instant)"
    return f"limit {numbers['limit']:g} (the policy: {policy.get('limit', 0):g})"
