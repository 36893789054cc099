"""Concurrent requests limiter: at most ``limit`` requests in flight per user.

Each admitted request holds a lease (a member of a sorted set scored by its expiry).
The lease is released when Envoy's access log reports the request finished, or expires
after ``lease_ttl``. Answers 429. ``limit`` is per customer: the limiter's own, its plan's
(``plans``) or a live override's.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core.context import RequestContext
from ..core.verdict import Limits, Outcome, Quota, Verdict
from ..policy.schema import ConcurrentRequestsSpec
from ..store.base import LeaseOp, OpResult
from ..store.keys import Keys
from .base import BY_IDENTITY, KeyOf, PerCustomer, denied_outcome, override_limit

#: seconds a client is told to wait after a concurrency refusal.
RETRY_AFTER = 1.0


def lease_limits(limit: int) -> Limits:
    return Limits(limit=limit, quota=Quota(limit=limit, window=None, unit="concurrent-requests"))


class ConcurrentRequestsLimiter(PerCustomer):
    def __init__(self, spec: ConcurrentRequestsSpec, keys: Keys, key: KeyOf = BY_IDENTITY) -> None:
        super().__init__(spec, keys, key)
        self.limit = spec.limit
        self.ttl = spec.lease_ttl
        self.own = lease_limits(spec.limit)
        self.quota = self.own.quota
        self.plans: dict[str, Limits] = {
            name: lease_limits(p.limit) for name, p in (spec.plans or {}).items()
        }

    def override(self, numbers: Mapping[str, float]) -> dict[str, Limits]:
        """An override's numbers, the same for every plan. ValueError when they do not fit."""
        return {"": lease_limits(override_limit(numbers, "concurrent_requests"))}

    def op(self, ctx: RequestContext, enforce: bool) -> LeaseOp:
        return LeaseOp(self._keys.user_leases(self.name, self.key.of(ctx) or ctx.identity),
                       self.limits(ctx).limit, self.ttl, enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        n = self.limits(ctx)
        if result.allowed:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=n.limit,
                           remaining=result.remaining, quota=n.quota)
        plan = f" (plan {ctx.plan})" if ctx.plan else ""
        return Verdict(self.name, self.kind, denied_outcome(enforce), limit=n.limit,
                       remaining=0.0, retry_after=RETRY_AFTER,
                       reason="concurrency_exceeded", quota=n.quota,
                       detail=(f"Concurrent requests limit '{self.name}' exceeded{plan}: at most "
                               f"{n.limit} requests in flight per user. Wait for a request "
                               f"to finish before sending another."))
