"""Worker utilization load shedder: the seed's "last line of defense".

A background sampler (never the request path) reads the utilization signal every
``sample_interval`` and advances the shed controller (:mod:`extauthz.shed`) in the store,
so every replica on one Redis shares one level. Each request then draws against its
tier's drop probability: ``test`` first, then ``get``, then ``post``; never ``critical``.
A shed request gets 503.
"""

from __future__ import annotations

import math
import random

from ..context import RequestContext
from ..policy.model import compile_match
from ..policy.schema import WorkerUtilizationSpec
from ..shed import drop_probabilities
from ..store.base import LeaseOp, OpResult, ShedParams
from ..store.keys import Keys
from ..verdict import Kind, Outcome, Verdict
from .base import FleetWide, denied_outcome


class WorkerUtilizationShedder(FleetWide):
    kind = Kind.LOAD_SHEDDER

    def __init__(self, spec: WorkerUtilizationSpec, keys: Keys, *,
                 rng: random.Random | None = None, inflight_keys: tuple[str, ...] = ()) -> None:
        self.name = spec.name
        self.failure_mode = spec.failure_mode
        self.applies_to = compile_match(spec.applies_to)
        self.spec = spec
        self.signal = spec.signal
        self.sample_interval = spec.sample_interval
        self.params = ShedParams(
            good_below=spec.good_below, bad_above=spec.bad_above,
            delay_before_shedding=spec.delay_before_shedding,
            time_to_shed_all=spec.time_to_shed_all,
            ttl=max(60.0, 2 * (spec.delay_before_shedding + spec.time_to_shed_all)),
        )
        self.state_key = keys.shed_state(spec.name)
        self.signal_key = spec.signal.key or keys.signal(spec.name)
        self._rng = rng or random.Random()
        # The inflight signal counts leases: a fleet_usage limiter's when there is one,
        # else this limiter holds count-only leases of its own.
        self.own_lease_key: str | None = None
        if spec.signal.source == "inflight" and not inflight_keys:
            self.own_lease_key = keys.fleet_leases(spec.name, "all")
            inflight_keys = (self.own_lease_key,)
        self.inflight_keys = inflight_keys
        self.ttl = spec.lease_ttl
        self.retry_after = float(max(1, math.ceil(spec.sample_interval)))
        self.level = self.params.resting
        self.utilization: float | None = None
        self.probabilities = drop_probabilities(self.level)

    def set_level(self, level: float, utilization: float | None = None) -> None:
        self.level = level
        self.utilization = utilization
        self.probabilities = drop_probabilities(level)

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict:
        p = self.probabilities[ctx.tier]
        if p > 0.0 and self._rng.random() < p:
            return Verdict(self.name, self.kind, denied_outcome(enforce), limit=1.0,
                           remaining=1.0 - p, retry_after=self.retry_after,
                           reason=f"shedding_{ctx.tier.value}",
                           detail=(f"The API is overloaded and is shedding {ctx.tier.value} "
                                   f"traffic (load shedder '{self.name}', {p:.0%} of it now). "
                                   f"Retry later with backoff."))
        return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=1.0, remaining=1.0 - p)

    def op(self, ctx: RequestContext, enforce: bool) -> LeaseOp | None:
        if self.own_lease_key is None:
            return None
        return LeaseOp(self.own_lease_key, 0, self.ttl, enforce)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        # Count-only lease: never refuses; the local draw already decided.
        return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=1.0)
