"""Prometheus metrics, on a registry of their own.

Two kinds of metric, chosen by cost:

* **Per decision** (:class:`Metrics`, an Observer): ``extauthz_decisions_total`` and
  ``extauthz_requests_total``, and the store call histogram (:func:`instrument_store_check`).
  Label children are resolved once per policy (:meth:`Metrics.prime`), so a check does a
  dict lookup and an ``inc()`` per limiter.
* **Read at scrape time** (:class:`StateCollector`): everything the server already counts or
  holds (fail-opens by reason, shed levels, policy version, reload failures, leases in
  flight from :class:`LeaseSampler`, access-log counters, switches, the Redis store's round
  trips and script calls). Nothing per request.

Scrapes are served on the event loop (see :mod:`extauthz.server.ports`), so the collector
reads engine state from the thread that writes it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..context import RequestContext
from ..engine import Engine
from ..errors import CircuitOpen, StoreError, StoreInternalError, StoreTimeout, StoreUnavailable
from ..limiters import FleetUsageShedder, WorkerUtilizationShedder
from ..limiters.grants import GRANT_METRICS, grant_status
from ..policy.model import Policy
from ..store.base import CheckResult, Op
from ..tiers import Tier
from ..verdict import Decision, Kind, Mode, Outcome
from .base import ObserverBase

log = logging.getLogger("extauthz.metrics")

#: store call latency buckets: 0.25 ms .. 50 ms (the default deadline is 5 ms).
STORE_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05)

#: ``extauthz_requests_total{result}``: what the request got.
RESULTS = ("allowed", "rate_limited", "shed", "failed_closed")

#: fail-open reasons exported from the start (at 0), so rate() has a series to work on.
FAIL_REASONS = tuple(cls.reason for cls in (StoreTimeout, StoreUnavailable, CircuitOpen, StoreInternalError))

CheckFn = Callable[[Sequence[Op], str], Awaitable[CheckResult]]


def request_result(decision: Decision) -> str:
    refused = decision.denied_by
    if refused is None:
        return "allowed"
    if refused.outcome is Outcome.FAILED_CLOSED:
        return "failed_closed"
    return "rate_limited" if refused.kind is Kind.RATE_LIMITER else "shed"


class Metrics(ObserverBase):
    """The per-decision metrics. Use as the engine's observer (or one of them)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.decisions = Counter(
            "extauthz_decisions", "Limiter verdicts by limiter, tier, plan and outcome.",
            ["limiter", "tier", "plan", "outcome"], registry=self.registry,
        )
        self.requests = Counter(
            "extauthz_requests", "Checks by tier and result (allowed, rate_limited, shed, failed_closed).",
            ["tier", "result"], registry=self.registry,
        )
        self.store_call = Histogram(
            "extauthz_store_call_seconds", "Latency of the one store call a check makes.",
            buckets=STORE_BUCKETS, registry=self.registry,
        )
        self.skipped = Counter(
            "extauthz_limiter_skipped", "Requests a limiter did not apply to, by limiter and "
            "reason (key_missing: a part of its key yielded nothing).",
            ["limiter", "reason"], registry=self.registry,
        )
        self._skipped: dict[str, Any] = {}
        self._decisions: dict[tuple[str, Tier, str, Outcome], Any] = {}
        self._requests: dict[tuple[Tier, str], Any] = {
            (tier, result): self.requests.labels(tier.value, result) for tier in Tier for result in RESULTS
        }

    def prime(self, policy: Policy) -> None:
        """Resolve (and so export, at 0) every limiter x tier x plan x outcome series of
        ``policy`` (plans: the names the policy knows, so the label stays bounded)."""
        plans = sorted(policy.plan_names) or [""]
        for spec in policy.limiters:
            if getattr(spec, "key", None) and spec.name not in self._skipped:
                self._skipped[spec.name] = self.skipped.labels(spec.name, "key_missing")
            for tier in Tier:
                for plan in plans:
                    for outcome in Outcome:
                        key = (spec.name, tier, plan, outcome)
                        if key not in self._decisions:
                            self._decisions[key] = self.decisions.labels(
                                spec.name, tier.value, plan, outcome.value)

    # -- Observer -------------------------------------------------------------------------
    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        tier = decision.tier
        plan = ctx.plan
        children = self._decisions
        for v in decision.verdicts:
            child = children.get((v.limiter, tier, plan, v.outcome))
            if child is None:
                child = children[(v.limiter, tier, plan, v.outcome)] = self.decisions.labels(
                    v.limiter, tier.value, plan, v.outcome.value)
            child.inc()
        for name in decision.skipped:
            skipped = self._skipped.get(name)
            if skipped is None:
                skipped = self._skipped[name] = self.skipped.labels(name, "key_missing")
            skipped.inc()
        self._requests[(tier, request_result(decision))].inc()

    def request_counts(self) -> dict[str, Any]:
        """Checks since start by result, and by tier and result (``/status``'s ``checks``)."""
        by_tier: dict[str, dict[str, int]] = {}
        for metric in self.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    by_tier.setdefault(sample.labels["tier"], {})[sample.labels["result"]] = int(sample.value)
        totals = {result: sum(row.get(result, 0) for row in by_tier.values()) for result in RESULTS}
        return {**totals, "by_tier": by_tier}


class AccessLogCounters(Protocol):
    entries: int


class ReloadState(Protocol):
    reloads: int
    failures: int

    @property
    def failing(self) -> bool: ...


class LeaseSampler:
    """Samples the fleet-wide lease keys (``store.inflight``) in the background, never per
    request: ``fleet_usage`` (critical + other) and ``worker_utilization``'s own count."""

    def __init__(self, engine: Engine, interval: float = 2.0) -> None:
        self.engine = engine
        self.interval = interval
        self.values: dict[str, int] = {}
        self.errors = 0

    def keys(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        for lim in self.engine.snapshot.limiters:
            if isinstance(lim, FleetUsageShedder):
                out[lim.name] = lim.lease_keys
            elif isinstance(lim, WorkerUtilizationShedder) and lim.own_lease_key is not None:
                out[lim.name] = (lim.own_lease_key,)
        return out

    async def sample_once(self) -> None:
        per_limiter = self.keys()
        flat = [k for keys in per_limiter.values() for k in keys]
        if not flat:
            self.values = {}
            return
        try:
            counts = await self.engine.store.inflight(flat)
        except StoreError:
            self.errors += 1
            return
        it = iter(counts)
        self.values = {name: sum(next(it) for _ in keys) for name, keys in per_limiter.items()}


def _grant_metrics(status: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """Batched grants' counters (:data:`~extauthz.limiters.grants.GRANT_METRICS`), by limiter."""
    for field, (name, counter, text) in GRANT_METRICS.items():
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, text, labels=["limiter"])
        for limiter, values in sorted(status.items()):
            family.add_metric([limiter], values[field])
        yield family


class StateCollector:
    """Exports, at scrape time, what the server already holds. Register it on the
    :class:`Metrics` registry."""

    def __init__(self, engine: Engine, *, accesslog: AccessLogCounters | None = None,
                 reload: ReloadState | None = None, leases: LeaseSampler | None = None,
                 shadow_dropped: Callable[[], int] | None = None,
                 background_errors: Callable[[], dict[str, int]] | None = None,
                 bad_requests: Callable[[], int] | None = None) -> None:
        self.engine = engine
        self.background_errors = background_errors
        self.bad_requests = bad_requests
        self.accesslog = accesslog
        self.reload = reload
        self.leases = leases
        self.shadow_dropped = shadow_dropped

    def describe(self) -> list[Metric]:
        return []  # names are dynamic; do not collect at registration

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        snap = engine.snapshot
        fail = CounterMetricFamily("extauthz_fail_open", "Failures met while deciding (store "
                                   "timeout/unavailable, circuit_open, internal_error: an unexpected "
                                   "exception), each failing its limiters open or closed per "
                                   "failure_mode, by reason.", labels=["reason"])
        counts = dict.fromkeys(FAIL_REASONS, 0) | engine.failures
        for reason, n in sorted(counts.items()):
            fail.add_metric([reason], n)
        yield fail

        level = GaugeMetricFamily("extauthz_shed_level", "Drop probability per tier of each "
                                  "worker_utilization shedder.", labels=["limiter", "tier"])
        ctl = GaugeMetricFamily("extauthz_shed_controller_level", "The shed controller's level "
                                "(below 0: not shedding; 1: shedding every tier but critical).",
                                labels=["limiter"])
        for w in snap.workers:
            ctl.add_metric([w.name], w.level)
            for tier, p in w.probabilities.items():
                level.add_metric([w.name, tier.value], p)
        util = GaugeMetricFamily("extauthz_shed_utilization", "The utilization signal each "
                                 "worker_utilization shedder read last (absent before its first "
                                 "sample).", labels=["limiter"])
        for w in snap.workers:
            if w.utilization is not None:
                util.add_metric([w.name], w.utilization)
        yield level
        yield ctl
        yield util
        capacity = GaugeMetricFamily("extauthz_fleet_capacity", "In-flight requests each "
                                     "fleet_usage shedder allows the whole fleet (all tiers), "
                                     "to set against extauthz_leases_in_flight.", labels=["limiter"])
        for lim in snap.limiters:
            if isinstance(lim, FleetUsageShedder):
                capacity.add_metric([lim.name], lim.capacity)
        yield capacity

        yield from _grant_metrics(grant_status(snap.limiters))

        info = GaugeMetricFamily("extauthz_policy_info", "The policy version being served (1).",
                                 labels=["version"])
        info.add_metric([snap.policy.version], 1)
        yield info

        now = engine.clock.wall()
        live = sum(1 for o in engine.overrides if o.expires_at > now)
        not_applied = len(snap.overrides_not_applied)
        overrides = GaugeMetricFamily("extauthz_overrides", "Live per-customer overrides, by "
                                      "whether they apply (a limiter the policy no longer has: no).",
                                      labels=["applied"])
        overrides.add_metric(["yes"], live - not_applied)
        overrides.add_metric(["no"], not_applied)
        yield overrides

        modes = {spec.name: Mode(spec.mode) for spec in snap.policy.limiters}
        mode = GaugeMetricFamily("extauthz_limiter_mode", "Effective mode of each limiter "
                                 "(policy mode overridden by kill switches): 1 for the current one.",
                                 labels=["limiter", "mode"])
        for name, policy_mode in modes.items():
            current = snap.switches.effective(name, policy_mode)
            for m in Mode:
                mode.add_metric([name, m.value], 1 if m is current else 0)
        yield mode
        switched = GaugeMetricFamily("extauthz_switches_set", "Kill switches currently set "
                                     "(1 per switch; '*' is the global one).", labels=["switch", "mode"])
        for name, value in snap.switches.to_dict().items():
            switched.add_metric([name, value], 1)
        yield switched

        releases = CounterMetricFamily(
            "extauthz_lease_releases", "Lease release calls by path (access_log, request_id_index, "
            "cancelled_check, abandoned_answer) and outcome (released; none: nothing was held, "
            "e.g. expired; retried: a failed try, tried again; error: failed until the longest "
            "lease TTL, which was the backstop).", labels=["path", "outcome"])
        for (path, outcome), n in engine.releaser.counts.items():
            releases.add_metric([path, outcome], n)
        yield releases

        yield CounterMetricFamily("extauthz_unknown_tiers", "Tier names in route metadata or "
                                  "context extensions that are not a tier (the rules or the method default "
                                  "tier applied).", value=snap.classifier.unknown_tiers)
        yield CounterMetricFamily("extauthz_plan_unknown", "Requests naming a plan the policy does "
                                  "not know (the default plan applied).", value=snap.classifier.unknown_plans)

        stats = engine.store.stats
        if stats is not None:  # the Redis store's own counters
            yield CounterMetricFamily("extauthz_store_round_trips", "Round trips to Redis: one per "
                                      "pipeline write (per master on a cluster) or single call, "
                                      "script loads included.", value=stats.round_trips)
            yield CounterMetricFamily("extauthz_store_script_calls", "Lua script calls sent to Redis "
                                      "(EVALSHA; releases merged into one call count once).",
                                      value=stats.commands)

        breaker = GaugeMetricFamily("extauthz_store_breaker_open", "1 while the store circuit "
                                    "breaker skips the store (open or half-open).")
        breaker.add_metric([], 0 if engine.breaker_state == "closed" else 1)
        yield breaker

        if self.reload is not None:
            yield CounterMetricFamily("extauthz_policy_reload_failures", "Policy reloads that failed "
                                      "(the last good policy kept serving).", value=self.reload.failures)
            yield CounterMetricFamily("extauthz_policy_reloads", "Policy reloads that took effect.",
                                      value=self.reload.reloads)
            yield GaugeMetricFamily("extauthz_policy_reload_error", "1 while the policy files on disk "
                                    "do not load (the last good policy serving).",
                                    value=1 if self.reload.failing else 0)
        if self.leases is not None:
            inflight = GaugeMetricFamily("extauthz_leases_in_flight", "Fleet-wide leases held "
                                         "(sampled in the background).", labels=["limiter"])
            for name, n in sorted(self.leases.values.items()):
                inflight.add_metric([name], n)
            yield inflight
        if self.accesslog is not None:
            yield CounterMetricFamily("extauthz_access_log_entries", "Envoy access-log entries received.",
                                      value=self.accesslog.entries)
        if self.bad_requests is not None:
            yield CounterMetricFamily("extauthz_bad_requests", "CheckRequests the edge could not "
                                      "read (answered allowed).", value=self.bad_requests())
        if self.background_errors is not None:
            bg = CounterMetricFamily("extauthz_background_errors", "Background job runs that raised "
                                     "(the job keeps running), by job.", labels=["job"])
            for job, n in sorted(self.background_errors().items()):
                bg.add_metric([job], n)
            yield bg
        if self.shadow_dropped is not None:
            yield CounterMetricFamily("extauthz_shadow_events_dropped", "Shadow would-denial "
                                      "records dropped (buffer full or store error).",
                                      value=self.shadow_dropped())


def instrument_store_check(check: CheckFn, *, histogram: Histogram | None = None,
                           tracer: Any = None, store_name: str = "") -> CheckFn:
    """Wrap the engine's store call: latency histogram and/or a child span per call."""
    if histogram is None and tracer is None:
        return check
    from time import perf_counter

    if tracer is None:
        assert histogram is not None
        observe = histogram.observe

        async def timed(ops: Sequence[Op], lease_id: str) -> CheckResult:
            t0 = perf_counter()
            try:
                return await check(ops, lease_id)
            finally:
                observe(perf_counter() - t0)

        return timed

    from opentelemetry.trace import SpanKind

    observe_or_none = histogram.observe if histogram is not None else None
    start_span = tracer.start_as_current_span

    async def traced(ops: Sequence[Op], lease_id: str) -> CheckResult:
        t0 = perf_counter()
        try:
            with start_span("extauthz.store.check", kind=SpanKind.CLIENT,
                            attributes={"extauthz.store": store_name, "extauthz.store.ops": len(ops)}):
                return await check(ops, lease_id)
        finally:
            if observe_or_none is not None:
                observe_or_none(perf_counter() - t0)

    return traced
