"""Concurrent requests limiter: at most ``limit`` requests in flight per user.

Each admitted request holds a lease (a member of a sorted set scored by its expiry).
The lease is released when Envoy's access log reports the request finished, or expires
after ``lease_ttl``. Answers 429.
"""

from __future__ import annotations

from ..context import RequestContext
from ..policy.model import compile_match
from ..policy.schema import ConcurrentRequestsSpec
from ..store.base import LeaseOp, OpResult
from ..store.keys import Keys
from ..verdict import Kind, Outcome, Quota, Verdict
from .base import denied_outcome

#: seconds a client is told to wait after a concurrency refusal.
RETRY_AFTER = 1.0


class ConcurrentRequestsLimiter:
    kind = Kind.RATE_LIMITER

    def __init__(self, spec: ConcurrentRequestsSpec, keys: Keys) -> None:
        self.name = spec.name
        self.failure_mode = spec.failure_mode
        self.applies_to = compile_match(spec.applies_to)
        self.limit = spec.limit
        self.ttl = spec.lease_ttl
        self._keys = keys
        self.quota = Quota(limit=spec.limit, window=None, unit="concurrent-requests")

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        return None

    def op(self, ctx: RequestContext, enforce: bool) -> LeaseOp:
        return LeaseOp(self._keys.user_leases(self.name, ctx.identity), self.limit, self.ttl, enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        if result.allowed:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.limit,
                           remaining=result.remaining, quota=self.quota)
        return Verdict(self.name, self.kind, denied_outcome(enforce), limit=self.limit,
                       remaining=0.0, retry_after=RETRY_AFTER,
                       reason="concurrency_exceeded", quota=self.quota,
                       detail=(f"Concurrent requests limit '{self.name}' exceeded: at most "
                               f"{self.limit} requests in flight per user. Wait for a request "
                               f"to finish before sending another."))
