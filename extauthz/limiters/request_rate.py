"""Request rate limiter: a token bucket per user (the seed's ``request_rate_limiter.lua``).

``rate`` tokens per second refill continuously (sub-second precision) up to ``burst``;
a request takes ``cost`` tokens; a refused request takes nothing. Answers 429.
"""

from __future__ import annotations

import math

from ..context import RequestContext
from ..policy.model import compile_match
from ..policy.schema import RequestRateSpec
from ..store.base import BucketOp, OpResult
from ..store.keys import Keys
from ..verdict import Kind, Outcome, Quota, Verdict
from .base import denied_outcome


class RequestRateLimiter:
    kind = Kind.RATE_LIMITER

    def __init__(self, spec: RequestRateSpec, keys: Keys) -> None:
        self.name = spec.name
        self.failure_mode = spec.failure_mode
        self.applies_to = compile_match(spec.applies_to)
        self.rate = spec.rate
        self.burst = spec.burst
        self.cost = spec.cost
        self._keys = keys
        self.quota = Quota(limit=spec.burst, window=math.ceil(spec.burst / spec.rate))

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        return None

    def op(self, ctx: RequestContext, enforce: bool) -> BucketOp:
        return BucketOp(self._keys.bucket(self.name, ctx.identity), self.rate, self.burst,
                        self.cost, enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        if result.allowed:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.burst,
                           remaining=result.remaining, reset=result.extra, quota=self.quota)
        return Verdict(self.name, self.kind, denied_outcome(enforce), limit=self.burst,
                       remaining=result.remaining, retry_after=result.retry_after,
                       reset=result.extra, reason="rate_exceeded", quota=self.quota,
                       detail=(f"Request rate limit '{self.name}' exceeded: bursts of up to "
                               f"{self.burst:g} requests, refilled at {self.rate:g} per second. "
                               f"Slow down and retry after the Retry-After delay."))
