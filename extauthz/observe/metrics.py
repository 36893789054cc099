"""Prometheus metrics, on a registry of their own.

Three kinds of metric, chosen by cost:

* **Per decision** (:class:`Metrics`, an Observer): ``extauthz_decisions_total`` and
  ``extauthz_requests_total``, and the store call histogram (:func:`instrument_store_check`).
  Label children are resolved once per policy (:meth:`Metrics.prime`), so a check does a
  dict lookup and an ``inc()`` per limiter.
* **Per check, plain ints** (:class:`CheckDurations`): ``extauthz_check_duration_seconds`` by
  door and decision, bucket counts kept in lists and turned into a histogram at scrape time.
* **Read at scrape time**: ``extauthz_limiter_decisions_total{limiter,outcome}`` (the
  decisions counter summed over tier and plan: no count of its own on the request path), and
  everything the server already counts or holds (fail-opens by reason, shed levels, policy
  version, reload failures, leases in flight, access-log counters, switches, the recorder,
  the Redis store's round trips and script calls), from the same per-component parts as
  ``/status`` (:mod:`extauthz.engine.state`). Nothing per request.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ..core.context import RequestContext
from ..core.tiers import Tier
from ..core.verdict import Decision, Kind, Outcome
from ..policy.model import Policy
from ..store.base import CheckResult, Op
from .base import ObserverBase

log = logging.getLogger("extauthz.metrics")

#: store call latency buckets: 0.25 ms .. 50 ms (the default deadline is 5 ms).
STORE_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05)

#: ``extauthz_requests_total{result}``: what the request got.
RESULTS = ("allowed", "rate_limited", "shed", "failed_closed")

#: ``extauthz_check_duration_seconds`` buckets: 100 us .. 1 s.
CHECK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

#: ``extauthz_check_duration_seconds{door}``: the front doors (a Door's ``name``).
DOORS = ("grpc", "http", "ratelimit")

CheckFn = Callable[[Sequence[Op], str], Awaitable[CheckResult]]


def request_result(decision: Decision) -> str:
    refused = decision.denied_by
    if refused is None:
        return "allowed"
    if refused.outcome is Outcome.FAILED_CLOSED:
        return "failed_closed"
    return "rate_limited" if refused.kind is Kind.RATE_LIMITER else "shed"


class CheckDurations:
    """``extauthz_check_duration_seconds{door,decision}``: the time a check spends in the check
    flow (``server/flow.py``: read, decide, leases, answer), per front door and by what the
    request got (:data:`RESULTS`). A check adds one to a plain list and its time to a float
    (no lock, no label lookup: the doors and the flow run on the one event loop); the
    histogram is built at scrape time (a collector on the :class:`Metrics` registry)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        #: (door, result) -> [sum of seconds, count per bucket (not cumulative)..., count above 1 s]
        self.rows: dict[tuple[str, str], list[float]] = {
            (door, result): [0.0] * (len(CHECK_BUCKETS) + 2) for door in DOORS for result in RESULTS}

    def observe(self, door: str, decision: Decision, seconds: float) -> None:
        row = self.rows[(door, request_result(decision))]
        row[0] += seconds
        row[bisect_left(CHECK_BUCKETS, seconds) + 1] += 1

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "extauthz_check_duration_seconds", "Time a check spent in this server from its "
            "front door's read to its answer (classify, decide, leases), by door (grpc, http) "
            "and decision (allowed, rate_limited, shed, failed_closed).", labels=["door", "decision"])
        bounds = [floatToGoString(b) for b in CHECK_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
        for (door, result), row in self.rows.items():
            total, buckets = 0, []
            for bound, n in zip(bounds, row[1:], strict=True):
                total += int(n)
                buckets.append((bound, total))
            family.add_metric([door, result], buckets, row[0])
        yield family


class LimiterDecisions:
    """``extauthz_limiter_decisions_total{limiter,outcome}``: ``extauthz_decisions_total``
    summed over tier and plan at scrape time (allowed as well as refused, per limiter; never
    per customer), so a check counts once. ``allowed`` is the limiter's own verdict, also on a
    request another limiter refused (nothing committed); a request refused before the store
    call gives verdicts only for the limiters that decided locally (docs/operations.md)."""

    def __init__(self, decisions: Counter) -> None:
        self.decisions = decisions

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        sums: dict[tuple[str, str], float] = {}
        for metric in self.decisions.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["limiter"], sample.labels["outcome"])
                    sums[key] = sums.get(key, 0.0) + sample.value
        family = CounterMetricFamily(
            "extauthz_limiter_decisions", "Limiter verdicts by limiter and outcome (allowed, "
            "denied, shadow_denied, failed_open, failed_closed), all tiers and plans.",
            labels=["limiter", "outcome"])
        for (limiter, outcome), n in sorted(sums.items()):
            family.add_metric([limiter, outcome], n)
        yield family


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
        #: the check flow's timings (``extauthz_check_duration_seconds``)
        self.durations = CheckDurations()
        self.registry.register(self.durations)
        self.registry.register(LimiterDecisions(self.decisions))
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
            if spec.key and spec.name not in self._skipped:
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
