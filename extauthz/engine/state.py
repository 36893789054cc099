"""The server's state, per component, rendered twice from one read: as JSON keys of the
admin ``/status`` and as Prometheus families on ``/metrics``.

Each :class:`Part` owns one component's figures (the engine's fail-opens, the shedders, the
policy reload, the leases in flight, the access log, ...): :meth:`Part.status` gives its
``/status`` keys and :meth:`Part.metrics` its metric families, both from the same fields, so
a counter is never exported by hand twice. A :class:`Panel` holds the parts in ``/status``
order; it is the Prometheus collector, and :meth:`Panel.status` is the document. A new
component (e.g. batched limiters' grant counters) adds one part: :meth:`Panel.add`.

The metric names, labels and ``/status`` keys are the ones operators and the Grafana
dashboard rely on (tests/observe/test_metrics.py, test_dashboard.py).

Scrapes are served on the event loop (see :mod:`extauthz.server.ports`), so the parts read
engine state from the thread that writes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..control.overrides import MAX_OVERRIDES, describe
from ..control.switches import limiter_modes
from ..core.errors import CircuitOpen, Overloaded, StoreError, StoreInternalError, StoreTimeout, StoreUnavailable
from ..core.tiers import Tier
from ..core.verdict import Mode
from ..limiters import FleetUsageShedder, WorkerUtilizationShedder
from ..limiters.grants import GRANT_METRICS
from ..store.memory import MemoryStore
from .engine import Engine
from .overload import LoopLag
from .release import releases_status

#: fail-open reasons exported from the start (at 0), so rate() has a series to work on.
FAIL_REASONS = tuple(cls.reason for cls in (StoreTimeout, StoreUnavailable, CircuitOpen, StoreInternalError,
                                             Overloaded))


class Part(Protocol):
    """One component's state: its ``/status`` keys and its metric families."""

    def status(self) -> Mapping[str, Any]: ...

    def metrics(self) -> Iterable[Metric]: ...


class Panel:
    """The server's parts in ``/status`` order; registered as a Prometheus collector."""

    def __init__(self, parts: Iterable[Part] = ()) -> None:
        self.parts: list[Part] = list(parts)

    def add(self, part: Part) -> None:
        self.parts.append(part)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.status())
        return out

    def describe(self) -> list[Metric]:
        return []  # names are dynamic; do not collect at registration

    def collect(self) -> Iterator[Metric]:
        for part in self.parts:
            yield from part.metrics()


class Section:
    """A part made of two functions (either may be absent): for a component that reports
    in one form only (``tracing``, ``tls``; the classifier's counters)."""

    def __init__(self, status: Callable[[], Mapping[str, Any]] | None = None,
                 metrics: Callable[[], Iterable[Metric]] | None = None) -> None:
        self._status = status
        self._metrics = metrics

    def status(self) -> Mapping[str, Any]:
        return self._status() if self._status is not None else {}

    def metrics(self) -> Iterable[Metric]:
        return self._metrics() if self._metrics is not None else ()


def counter(name: str, help: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help, value=value)


# -- the engine's parts -------------------------------------------------------------------


@dataclass(eq=False)
class PolicyPart:
    engine: Engine

    def status(self) -> Mapping[str, Any]:
        policy = self.engine.snapshot.policy
        return {"policy": {"version": policy.version, "sources": list(policy.sources)}}

    def metrics(self) -> Iterable[Metric]:
        info = GaugeMetricFamily("extauthz_policy_info", "The policy version being served (1).",
                                 labels=["version"])
        info.add_metric([self.engine.snapshot.policy.version], 1)
        yield info


class ReloadState(Protocol):
    reloads: int
    failures: int

    @property
    def failing(self) -> bool: ...

    def status(self) -> dict[str, object]: ...


@dataclass(eq=False)
class ReloadPart:
    """The policy watcher's reloads (``None``: not watching; then no reload metrics)."""

    engine: Engine
    watcher: ReloadState | None

    def status(self) -> Mapping[str, Any]:
        if self.watcher is not None:
            return {"reload": self.watcher.status()}
        policy = self.engine.snapshot.policy
        return {"reload": {"version": policy.version, "sources": list(policy.sources), "last_error": None,
                           "failures": 0, "reloads": 0, "watching": []}}

    def metrics(self) -> Iterable[Metric]:
        w = self.watcher
        if w is None:
            return
        yield counter("extauthz_policy_reload_failures", "Policy reloads that failed "
                      "(the last good policy kept serving).", w.failures)
        yield counter("extauthz_policy_reloads", "Policy reloads that took effect.", w.reloads)
        yield GaugeMetricFamily("extauthz_policy_reload_error", "1 while the policy files on disk "
                                "do not load (the last good policy serving).", value=1 if w.failing else 0)


@dataclass(eq=False)
class StorePart:
    """The store and its circuit breaker."""

    engine: Engine

    def status(self) -> Mapping[str, Any]:
        gate, store = self.engine.gate, self.engine.store
        return {"store": {
            # failures in the breakers' current windows: on a cluster the masters' breakers
            # decide (the gate's own is only their template)
            "name": store.name, "breaker": gate.breaker_state,
            "window_failures": gate.breaker.failures + sum(b.failures for b in gate.node_breakers.values()),
            "deadline_extended": gate.deadline_extended,
            "deadline_missed": dict(gate.deadline_missed),
            "abandoned_grant_returns": gate.grants.abandoned_returns,
            **({"masters": {name: b.state for name, b in sorted(gate.node_breakers.items())}}
               if gate.node_breakers else {}),
            **({"live_leases": store.live_leases(), "max_keys_per_limiter": store.max_keys,
                "keys": store.held(), "evictions": dict(sorted(store.evictions.items()))}
               if isinstance(store, MemoryStore) else {})}}

    def metrics(self) -> Iterable[Metric]:
        stats = self.engine.store.stats
        if stats is not None:  # the Redis store's own counters
            yield counter("extauthz_store_round_trips", "Round trips to Redis: one per pipeline "
                          "write (per master on a cluster) or single call, script loads included.",
                          stats.round_trips)
            yield counter("extauthz_store_script_calls", "Lua script calls sent to Redis "
                          "(EVALSHA; releases merged into one call count once).", stats.commands)
        store = self.engine.store
        if isinstance(store, MemoryStore):
            evicted = CounterMetricFamily(
                "extauthz_store_evictions", "Per-user keys the embedded store forgot before they "
                "expired, its limiter at --memory-max-keys (a quota's count forgiven, a bucket "
                "refilled), by limiter.", labels=["limiter"])
            for name, n in sorted(store.evictions.items()):
                evicted.add_metric([name], n)
            yield evicted
        yield counter("extauthz_store_deadline_extended", "Store deadlines passed while the "
                      "store was not late (the check still queued in this server, written less "
                      "than a deadline before, or answered and not yet carried by this server's "
                      "busy event loop): the check waited on (a few deadlines at most).",
                      self.engine.gate.deadline_extended)
        missed = CounterMetricFamily(
            "extauthz_store_deadline_missed", "Store deadlines passed, by where the check was: "
            "queued (not written to the store yet, or written less than a deadline before: this "
            "server's own delay), redis (written at least a deadline before and unanswered: the "
            "store is late; the check fails open and the breaker counts it), loop (answered, the "
            "answer not yet carried to the check by this server's busy event loop).",
            labels=["where"])
        for where, n in self.engine.gate.deadline_missed.items():
            missed.add_metric([where], n)
        yield missed
        yield counter("extauthz_store_abandoned_grant_returns", "Batched grant give-backs of "
                      "requests that failed open (deadline, breaker, store error): the grant a late "
                      "answer took, less the request's cost, or the remainder a call never sent lent.",
                      self.engine.grants.abandoned_returns)
        breaker = GaugeMetricFamily("extauthz_store_breaker_open", "1 while the store circuit "
                                    "breaker skips the store (open or half-open).")
        breaker.add_metric([], 0 if self.engine.gate.breaker_state == "closed" else 1)
        yield breaker


@dataclass(eq=False)
class FailOpenPart:
    engine: Engine

    def status(self) -> Mapping[str, Any]:
        return {"fail_open": dict(sorted(self.engine.failures.items()))}

    def metrics(self) -> Iterable[Metric]:
        fail = CounterMetricFamily("extauthz_fail_open", "Failures met while deciding (store "
                                   "timeout/unavailable, circuit_open, internal_error: an unexpected "
                                   "exception), each failing its limiters open or closed per "
                                   "failure_mode, by reason.", labels=["reason"])
        for reason, n in sorted((dict.fromkeys(FAIL_REASONS, 0) | self.engine.failures).items()):
            fail.add_metric([reason], n)
        yield fail


@dataclass(eq=False)
class OverloadPart:
    """The loop's lag and the checks decided starved or out of time (``extauthz.engine.overload``)."""

    lag: LoopLag

    def status(self) -> Mapping[str, Any]:
        return self.lag.status()

    def metrics(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("extauthz_loop_lag_seconds", "How late the event loop runs "
                                "(the lag sampler's last wake-up, or longer while it is overdue); "
                                "the server is starved from half the check budget (gRPC: the "
                                "part of it the process did not run through).",
                                value=self.lag.lag())
        checks = CounterMetricFamily("extauthz_overload_checks", "Checks decided while the "
                                     "server was starved (shedders refused non-critical ones), "
                                     "by tier.", labels=["tier"])
        for tier, n in sorted((dict.fromkeys([t.value for t in Tier], 0) | self.lag.overloaded).items()):
            checks.add_metric([tier], n)  # every tier from the start, so rate() has a series
        yield checks


@dataclass(eq=False)
class ModesPart:
    """Kill switches and each limiter's effective mode."""

    engine: Engine

    def status(self) -> Mapping[str, Any]:
        snap = self.engine.snapshot
        return {"switches": snap.switches.to_dict(), "limiters": limiter_modes(snap.switches, snap.policy.limiters)}

    def metrics(self) -> Iterable[Metric]:
        mode = GaugeMetricFamily("extauthz_limiter_mode", "Effective mode of each limiter "
                                 "(policy mode overridden by kill switches): 1 for the current one.",
                                 labels=["limiter", "mode"])
        snap = self.engine.snapshot
        for name, row in limiter_modes(snap.switches, snap.policy.limiters).items():
            for m in Mode:
                mode.add_metric([name, m.value], 1 if m.value == row["mode"] else 0)
        yield mode
        switched = GaugeMetricFamily("extauthz_switches_set", "Kill switches currently set "
                                     "(1 per switch; '*' is the global one).", labels=["switch", "mode"])
        for name, value in self.engine.snapshot.switches.to_dict().items():
            switched.add_metric([name, value], 1)
        yield switched


class OverridesPart:
    """Live overrides as the engine applies them; with the replica's board (``poll``: its
    errors and updates) the ``/status`` section too."""

    def __init__(self, engine: Engine, poll: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.engine = engine
        self.poll = poll

    def rows(self) -> list[dict[str, Any]]:
        engine = self.engine
        return describe(engine.overrides, engine.snapshot.overrides_not_applied, engine.clock.wall())

    def status(self) -> Mapping[str, Any]:
        if self.poll is None:
            return {}
        rows, poll = self.rows(), self.poll()
        return {"overrides": {"live": len(rows), "max": MAX_OVERRIDES,
                              "not_applied": [r for r in rows if not r["applied"]],
                              "poll_errors": poll["errors"], "updates": poll["updates"]}}

    def metrics(self) -> Iterable[Metric]:
        rows = self.rows()
        applied = sum(1 for r in rows if r["applied"])
        overrides = GaugeMetricFamily("extauthz_overrides", "Live per-customer overrides, by "
                                      "whether they apply (a limiter the policy no longer has: no).",
                                      labels=["applied"])
        overrides.add_metric(["yes"], applied)
        overrides.add_metric(["no"], len(rows) - applied)
        yield overrides


@dataclass(eq=False)
class ShedPart:
    """The shedders: worker_utilization levels, fleet_usage capacity."""

    engine: Engine

    def status(self) -> Mapping[str, Any]:
        return {"shedding": [
            {"limiter": w.name, "level": w.level, "utilization": w.utilization,
             "probabilities": {t.value: p for t, p in w.probabilities.items()}}
            for w in self.engine.snapshot.workers]}

    def metrics(self) -> Iterable[Metric]:
        snap = self.engine.snapshot
        level = GaugeMetricFamily("extauthz_shed_level", "Drop probability per tier of each "
                                  "worker_utilization shedder.", labels=["limiter", "tier"])
        ctl = GaugeMetricFamily("extauthz_shed_controller_level", "The shed controller's level "
                                "(below 0: not shedding; 1: shedding every tier but critical).",
                                labels=["limiter"])
        util = GaugeMetricFamily("extauthz_shed_utilization", "The utilization signal each "
                                 "worker_utilization shedder read last (absent before its first "
                                 "sample).", labels=["limiter"])
        for w in snap.workers:
            ctl.add_metric([w.name], w.level)
            for tier, p in w.probabilities.items():
                level.add_metric([w.name, tier.value], p)
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


@dataclass(eq=False)
class ReleasesPart:
    engine: Engine

    def status(self) -> Mapping[str, Any]:
        return {"lease_releases": releases_status(self.engine.releaser)}

    def metrics(self) -> Iterable[Metric]:
        releases = CounterMetricFamily(
            "extauthz_lease_releases", "Lease release calls by path (access_log, request_id_index, "
            "cancelled_check, abandoned_answer) and outcome (released; none: nothing was held, "
            "e.g. expired; retried: a failed try, tried again; error: failed until the longest "
            "lease TTL, which was the backstop).", labels=["path", "outcome"])
        for (path, outcome), n in self.engine.releaser.counts.items():
            releases.add_metric([path, outcome], n)
        yield releases


@dataclass(eq=False)
class GrantsPart:
    """Batched grants (``consistency: batched``): each grant table's own counters, by limiter."""

    engine: Engine

    def status(self) -> Mapping[str, Any]:
        return {"grants": self.engine.grants.status()}

    def metrics(self) -> Iterable[Metric]:
        status = self.engine.grants.status()
        for field, (name, is_counter, text) in GRANT_METRICS.items():
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, text, labels=["limiter"])
            for limiter, values in sorted(status.items()):
                family.add_metric([limiter], values[field])
            yield family
        early = HistogramMetricFamily(
            "extauthz_early_refusal", "Batched grants given back unspent that stood on this "
            "replica while the shared state without them could not pay one request more: other "
            "replicas' requests were refused early meanwhile, by at most this much (tokens or "
            "fleet slots; see docs/limiters.md).", labels=["limiter"])
        for limiter, (buckets, total) in sorted(self.engine.grants.early().items()):
            early.add_metric([limiter], buckets, total)
        yield early


def classifier_part(engine: Engine) -> Section:
    def metrics() -> Iterator[Metric]:
        classifier = engine.snapshot.classifier
        yield counter("extauthz_unknown_tiers", "Tier names in route metadata or context extensions "
                      "that are not a tier (the rules or the method default tier applied).",
                      classifier.unknown_tiers)
        yield counter("extauthz_plan_unknown", "Requests naming a plan the policy does not know "
                      "(the default plan applied).", classifier.unknown_plans)

    return Section(metrics=metrics)


# -- the server's counters ------------------------------------------------------------------


def count_part(key: str, metric: str, help: str, read: Callable[[], int]) -> Section:
    """A single count: ``/status`` key ``key``, counter ``metric``."""
    return Section(lambda: {key: read()}, lambda: [counter(metric, help, read())])


def by_label_part(key: str, metric: str, help: str, label: str,
                  read: Callable[[], Mapping[str, int]]) -> Section:
    """Counts by one label: ``/status`` key ``key`` (sorted), counter ``metric{label}``."""
    def status() -> Mapping[str, Any]:
        return {key: dict(sorted(read().items()))}

    def metrics() -> Iterator[Metric]:
        family = CounterMetricFamily(metric, help, labels=[label])
        for name, n in sorted(read().items()):
            family.add_metric([name], n)
        yield family

    return Section(status, metrics)


class LeaseSampler:
    """Samples the fleet-wide lease keys (``store.inflight``) in the background, never per
    request: ``fleet_usage`` (critical + other) and ``worker_utilization``'s own count. A
    part: ``leases_in_flight`` on ``/status`` and ``/metrics``."""

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

    def status(self) -> Mapping[str, Any]:
        return {"leases_in_flight": dict(self.values)}

    def metrics(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily("extauthz_leases_in_flight", "Fleet-wide leases held "
                                     "(sampled in the background).", labels=["limiter"])
        for name, n in sorted(self.values.items()):
            inflight.add_metric([name], n)
        yield inflight


class RequestIndex(Protocol):
    def status(self) -> dict[str, int]: ...


class LeaseOwner(Protocol):
    @property
    def index(self) -> RequestIndex: ...


class AccessLog(Protocol):
    entries: int
    rejected: dict[str, int]

    @property
    def leases(self) -> LeaseOwner: ...


@dataclass(eq=False)
class AccessLogPart:
    """The access-log service: entries received, leases awaiting their entry, refusals."""

    accesslog: AccessLog

    def status(self) -> Mapping[str, Any]:
        log = self.accesslog
        index = log.leases.index.status()  # expires first: awaiting_log is its entries
        return {"access_log": {"entries": log.entries, "awaiting_log": index["entries"],
                               "request_id_index": index, "rejected": dict(sorted(log.rejected.items()))}}

    def metrics(self) -> Iterable[Metric]:
        yield counter("extauthz_access_log_entries", "Envoy access-log entries received.",
                      self.accesslog.entries)


#: the ``tier`` label values of ``extauthz_unchecked_requests_total``, exported from the start
#: (at 0): the tiers, and ``unknown`` (an entry that does not show its request)
UNCHECKED_TIERS = (*(t.value for t in Tier), "unknown")


class UncheckedCounts(Protocol):
    #: by tier, counted from their last entry
    unchecked: dict[str, int]
    #: the fleet's count of them in flight: counted, failed store calls, held now
    unchecked_counted: int
    unchecked_errors: int

    @property
    def unchecked_held(self) -> Mapping[str, object]: ...


@dataclass(eq=False)
class UncheckedPart:
    """Requests Envoy let through unchecked (``failure_mode_allow``: its fail-open header in
    the access-log entry, no decision of ours), by tier, counted when their entry arrives;
    and those the fleet limiters counted while in flight."""

    counts: UncheckedCounts

    def status(self) -> Mapping[str, Any]:
        c = self.counts
        counts = c.unchecked
        return {"unchecked_requests": {
            "total": sum(counts.values()), "by_tier": {t: counts.get(t, 0) for t in UNCHECKED_TIERS},
            "fleet": {"in_flight": len(c.unchecked_held), "counted": c.unchecked_counted,
                      "errors": c.unchecked_errors}}}

    def metrics(self) -> Iterable[Metric]:
        counts = self.counts.unchecked
        family = CounterMetricFamily("extauthz_unchecked_requests", "Requests Envoy let through "
                                     "without our decision (its ext_authz check failed or timed out "
                                     "and failure_mode_allow passed it), by tier, from the access log.",
                                     labels=["tier"])
        for tier in UNCHECKED_TIERS:
            family.add_metric([tier], counts.get(tier, 0))
        yield family


class ShadowCounts(Protocol):
    recorded: int
    flushed: int
    dropped: int

    @property
    def pending(self) -> int: ...


@dataclass(eq=False)
class ShadowPart:
    """The shadow recorder (would-denials of shadow limiters)."""

    shadow: ShadowCounts

    def status(self) -> Mapping[str, Any]:
        s = self.shadow
        return {"shadow": {"recorded": s.recorded, "flushed_events": s.flushed,
                           "pending": s.pending, "dropped": s.dropped}}

    def metrics(self) -> Iterable[Metric]:
        yield counter("extauthz_shadow_events_dropped", "Shadow would-denial records dropped "
                      "(buffer full or store error).", self.shadow.dropped)


class RecorderCounts(Protocol):
    def status(self) -> dict[str, Any]: ...


#: ``serve --record``'s /status keys exported as metrics: key -> (name, is a counter, help)
RECORDER_METRICS: dict[str, tuple[str, bool, str]] = {
    "recorded": ("extauthz_recorder_lines", True, "Lines the recorder (serve --record) queued for writing."),
    "lines_dropped": ("extauthz_recorder_lines_dropped", True, "Recorder lines not written: one line "
                      "larger, compressed, than a whole file."),
    "write_errors": ("extauthz_recorder_write_errors", True, "Recorder flushes whose write failed "
                     "(logged; their lines are lost)."),
    "unsampled": ("extauthz_recorder_unsampled", True, "Requests not recorded: their identity is "
                  "outside --record-sample."),
    "without_duration": ("extauthz_recorder_without_duration", True, "Lines written with no "
                         "duration (the access-log entry never came)."),
    "bytes_written": ("extauthz_recorder_bytes_written", True, "Compressed bytes the recorder wrote."),
    "files_deleted": ("extauthz_recorder_files_deleted", True, "Oldest recording files deleted to "
                      "keep --record-max-bytes."),
    "pending": ("extauthz_recorder_pending", False, "Recorded requests waiting for their "
                "access-log entry (their duration)."),
}


@dataclass(eq=False)
class RecorderPart:
    """``serve --record`` (``None``: not recording: ``"recorder": null`` and no metrics)."""

    recorder: RecorderCounts | None

    def status(self) -> Mapping[str, Any]:
        return {"recorder": self.recorder.status() if self.recorder is not None else None}

    def metrics(self) -> Iterable[Metric]:
        if self.recorder is None:
            return
        status = self.recorder.status()
        for key, (name, is_counter, text) in RECORDER_METRICS.items():
            yield (counter(name, text, status[key]) if is_counter
                   else GaugeMetricFamily(name, text, value=status[key]))
