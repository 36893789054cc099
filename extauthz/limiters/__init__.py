"""Limiters and load shedders, one module per kind, all behind :class:`Limiter`."""

from __future__ import annotations

import random

from ..core.clock import SYSTEM_CLOCK, Clock
from ..policy.model import Policy
from ..policy.schema import (
    ConcurrentRequestsSpec,
    FleetUsageSpec,
    QuotaSpec,
    RequestRateSpec,
    WorkerUtilizationSpec,
)
from ..store.base import Store
from ..store.keys import Keys
from .base import KeyOf, Limiter
from .concurrent import ConcurrentRequestsLimiter
from .fleet import FleetUsageShedder
from .quota import QuotaLimiter
from .request_rate import RequestRateLimiter
from .worker import WorkerUtilizationShedder

__all__ = [
    "ConcurrentRequestsLimiter",
    "FleetUsageShedder",
    "Limiter",
    "QuotaLimiter",
    "RequestRateLimiter",
    "WorkerUtilizationShedder",
    "build_limiters",
]


def build_limiters(policy: Policy, keys: Keys, rng: random.Random | None = None,
                   clock: Clock = SYSTEM_CLOCK, store: Store | None = None) -> tuple[Limiter, ...]:
    """One limiter object per policy entry, in policy order (``clock``: the refusal
    cache's, :mod:`.refusals`; ``store``: where batched grants are asked and given back,
    None for limiters that never take any, e.g. to check names); none for a ``request_rate``
    limiter with ``enforce: envoy`` (Envoy's quota filter holds its tokens:
    extauthz/engine/quota_service.py)."""
    fleet_keys: tuple[str, ...] = ()
    for spec in policy.limiters:
        if isinstance(spec, FleetUsageSpec) and spec.mode != "off":
            fleet_keys = FleetUsageShedder(spec, keys).lease_keys
            break
    out: list[Limiter] = []
    for spec in policy.limiters:
        if isinstance(spec, (RequestRateSpec, ConcurrentRequestsSpec, QuotaSpec)):
            key = KeyOf(policy.key_index.get(spec.name), spec.on_missing_key == "shared")
        if isinstance(spec, RequestRateSpec):
            if spec.enforce == "envoy":
                continue
            out.append(RequestRateLimiter(spec, keys, clock, key, store))
        elif isinstance(spec, ConcurrentRequestsSpec):
            out.append(ConcurrentRequestsLimiter(spec, keys, key))
        elif isinstance(spec, QuotaSpec):
            out.append(QuotaLimiter(spec, keys, clock, key, store))
        elif isinstance(spec, FleetUsageSpec):
            out.append(FleetUsageShedder(spec, keys, clock, store))
        elif isinstance(spec, WorkerUtilizationSpec):
            out.append(WorkerUtilizationShedder(spec, keys, rng=rng, inflight_keys=fleet_keys))
    return tuple(out)
