"""Request rate limiter: a token bucket per user (the seed's ``request_rate_limiter.lua``).

``rate`` tokens per second refill continuously (sub-second precision) up to ``burst``;
a request takes ``cost`` tokens; a refused request takes nothing. Answers 429.

The numbers are per customer: the limiter's own, its plan's (``plans``) or a live
override's, all resolved before the request (:meth:`RequestRateLimiter.limits` is two dict
lookups). The bucket key does not depend on the plan, so a customer whose plan changes keeps
its tokens, capped at the new ``burst`` on its next request (both stores refill with the
request's numbers and cap at its burst).

A user the store refused is refused locally until its bucket would admit again
(:mod:`.refusals`): a flood costs no store calls.

``consistency: batched``: the bucket is asked in grants of ``batch`` tokens, spent locally
(:mod:`.grants`); a request the grant covers needs no store call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.verdict import Limits, Outcome, Quota, Verdict
from ..policy.schema import (
    PLAN_NUMBERS,
    RequestRateSpec,
    bucket_problem,
    not_fields,
)
from ..store.base import BucketOp, GrantOp, OpResult, Store
from ..store.keys import Keys
from .base import BY_IDENTITY, KeyOf, PerCustomer, denied_outcome
from .grants import GrantTable, bucket_renew, default_batch
from .refusals import RefusalCache

#: the numbers an override (or a plan entry) of this kind may set.
NUMBERS = PLAN_NUMBERS["request_rate"]


def bucket_limits(rate: float, burst: float, cost: float) -> Limits:
    return Limits(rate=rate, burst=burst, cost=cost,
                  quota=Quota(limit=burst, window=math.ceil(burst / rate)))


def _merged(base: Limits, numbers: Mapping[str, float | None]) -> Limits:
    def pick(name: str, own: float) -> float:
        value = numbers.get(name)
        return own if value is None else float(value)

    rate, burst, cost = pick("rate", base.rate), pick("burst", base.burst), pick("cost", base.cost)
    problem = bucket_problem(rate, burst, cost)
    if problem is not None:
        raise ValueError(problem)
    return bucket_limits(rate, burst, cost)


class RequestRateLimiter(PerCustomer):
    def __init__(self, spec: RequestRateSpec, keys: Keys, clock: Clock = SYSTEM_CLOCK,
                 key: KeyOf = BY_IDENTITY, store: Store | None = None) -> None:
        super().__init__(spec, keys, key)
        self.rate = spec.rate
        self.burst = spec.burst
        self.cost = spec.cost
        self.own = bucket_limits(spec.rate, spec.burst, spec.cost)
        self.quota = self.own.quota
        #: plan name -> numbers (unset numbers are the limiter's own); validated at load.
        self.plans: dict[str, Limits] = {
            name: _merged(self.own, {"rate": p.rate, "burst": p.burst, "cost": p.cost})
            for name, p in (spec.plans or {}).items()
        }
        #: enforced refusals remembered until the bucket would admit again (None: off)
        self.refusals: RefusalCache | None = RefusalCache(clock)
        #: batched grants (``consistency: batched``), else None
        self.grants: GrantTable | None = None
        self.sync_interval = spec.sync_interval
        self.batch = spec.batch
        if spec.consistency == "batched":
            self.grants = GrantTable(self.sync_interval, clock, renew=bucket_renew,
                                     spend_within=self.sync_interval, store=store)
            self.refusals = RefusalCache(clock, max_window=self.sync_interval)
        #: the request whose cost :meth:`local` spent from a grant (its :meth:`op` is None)
        self._spent: RequestContext | None = None

    def override(self, numbers: Mapping[str, float]) -> dict[str, Limits]:
        """An override's numbers for each plan (``""``: a plan this limiter does not list);
        numbers the override does not set are the plan's. ValueError when they do not fit."""
        unknown = sorted(set(numbers) - set(NUMBERS))
        if unknown:
            raise ValueError(not_fields(unknown, "request_rate"))
        out = {"": _merged(self.own, numbers)}
        for name, limits in self.plans.items():
            try:
                out[name] = _merged(limits, numbers)
            except ValueError as exc:
                raise ValueError(f"with plan '{name}': {exc}") from None
        return out

    def _bucket(self, ctx: RequestContext) -> str:
        return self._keys.bucket(self.name, self.key.of(ctx) or ctx.identity)

    def want(self, n: Limits) -> float:
        """Tokens one grant takes for a customer with numbers ``n`` (``batch``, default
        :func:`.grants.default_batch`), at least one request's cost."""
        if self.batch is None:
            return default_batch(n.rate, self.sync_interval, n.cost)
        return max(self.batch, n.cost)

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        if enforce and self.refusals is not None:  # a shadow limiter never blocks
            n = self.limits(ctx)
            refused = self.refusals.refusal(self._bucket(ctx),
                                            n.rate, n.burst, ctx.cost(n.cost))
            if refused is not None:
                return refused
        if self.grants is None:
            return None
        n = self.limits(ctx)
        remaining = self.grants.spend(self._bucket(ctx), ctx.cost(n.cost), (n.rate, n.burst))
        if remaining is None:
            return None
        self._spent = ctx  # op() is called next, for the same request: nothing to ask
        return self._allowed(n, remaining)

    def _allowed(self, n: Limits, remaining: float) -> Verdict:
        reset = max(0.0, (n.burst - remaining) / n.rate)
        return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=n.burst,
                       remaining=remaining, reset=reset, quota=n.quota)

    def refund(self, ctx: RequestContext) -> None:
        """The request :meth:`local` admitted from a grant was refused by another limiter:
        its cost goes back to the grant (batched grants only)."""
        if self.grants is not None:
            n = self.limits(ctx)
            self.grants.restore(self._bucket(ctx), ctx.cost(n.cost), (n.rate, n.burst))

    def op(self, ctx: RequestContext, enforce: bool) -> BucketOp | GrantOp | None:
        if self._spent is not None:
            spent, self._spent = self._spent, None
            if spent is ctx:
                return None
        n = self.limits(ctx)
        key = self._bucket(ctx)
        if self.grants is not None:
            return GrantOp(key, n.rate, n.burst, ctx.cost(n.cost), self.want(n), enforce,
                           self.grants.lend(key, (n.rate, n.burst)))
        return BucketOp(key, n.rate, n.burst, ctx.cost(n.cost), enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        n = self.limits(ctx)
        if self.grants is not None:
            key = self._bucket(ctx)
            if result.extra <= 0.0:  # nothing committed: the remainder lent stays here
                self.grants.restore(key, -result.extra, (n.rate, n.burst))
            if result.allowed:
                remaining = result.remaining + self.grants.held(key)
                if result.extra > 0.0:  # a grant was taken: this request spends from it
                    remaining = self.grants.granted(key, result.extra, ctx.cost(n.cost), result.remaining,
                                                    self.want(n), (n.rate, n.burst))
                return self._allowed(n, remaining)
        if result.allowed:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=n.burst,
                           remaining=result.remaining, reset=result.extra, quota=n.quota)
        plan = f" (plan {ctx.plan})" if ctx.plan else ""
        refused = Verdict(
            self.name, self.kind, denied_outcome(enforce), limit=n.burst,
            remaining=result.remaining, retry_after=result.retry_after,
            reset=result.extra, reason="rate_exceeded", quota=n.quota,
            detail=(f"Request rate limit '{self.name}' exceeded{plan}: bursts of up to "
                    f"{n.burst:g} request{'' if n.burst == 1 else 's'}, refilled at {n.rate:g} per second. "
                    f"Slow down and retry after the Retry-After delay."))
        if enforce and self.refusals is not None:
            self.refusals.remember(self._bucket(ctx), refused,
                                   n.rate, n.burst, ctx.cost(n.cost))
        return refused
