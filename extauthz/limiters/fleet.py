"""Fleet usage load shedder: ``capacity`` in-flight requests for the whole fleet.

Non-critical requests are refused (503) once non-critical in-flight reaches
``floor((1 - reserved_for_critical) * capacity)``; critical requests hold a lease too
(they are counted for metrics and the utilization signal) but are never refused here.
"""

from __future__ import annotations

import math

from ..context import RequestContext
from ..policy.schema import FleetUsageSpec
from ..store.base import LeaseOp, OpResult
from ..store.keys import Keys
from ..tiers import Tier
from ..verdict import Outcome, Quota, Verdict
from .base import FleetWide, denied_outcome

RETRY_AFTER = 2.0


class FleetUsageShedder(FleetWide):
    def __init__(self, spec: FleetUsageSpec, keys: Keys) -> None:
        super().__init__(spec)
        self.capacity = spec.capacity
        self.noncritical_limit = max(1, math.floor((1 - spec.reserved_for_critical) * spec.capacity + 1e-9))
        self.ttl = spec.lease_ttl
        self.critical_key = keys.fleet_leases(self.name, "critical")
        self.other_key = keys.fleet_leases(self.name, "other")
        self.quota = Quota(limit=self.noncritical_limit, window=None, unit="concurrent-requests")

    @property
    def lease_keys(self) -> tuple[str, str]:
        return self.critical_key, self.other_key

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        return None

    def op(self, ctx: RequestContext, enforce: bool) -> LeaseOp:
        if ctx.tier is Tier.CRITICAL:
            return LeaseOp(self.critical_key, 0, self.ttl, enforce)
        return LeaseOp(self.other_key, self.noncritical_limit, self.ttl, enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        if ctx.tier is Tier.CRITICAL:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.capacity)
        if result.allowed:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.noncritical_limit,
                           remaining=result.remaining, quota=self.quota)
        return Verdict(self.name, self.kind, denied_outcome(enforce), limit=self.noncritical_limit,
                       remaining=0.0, retry_after=RETRY_AFTER, reason="fleet_capacity_reserved",
                       quota=self.quota,
                       detail=(f"The API is at capacity for non-critical traffic (load shedder "
                               f"'{self.name}'); the remaining capacity is reserved for critical "
                               f"requests. Retry later with backoff."))
