"""Operations around the engine, built once for a :class:`~extauthz.server.app.Server`,
as small owners wired together here: :class:`~.fleetstate.FleetState` (kill switches,
overrides, their rules, the change log), :class:`~.opsports.OperatorPorts` (the admin and
metrics ports), the policy watcher and the lease sampler (background jobs on the server's
:class:`~extauthz.runner.Runner`), and the :class:`~extauthz.observe.state.Panel` that
renders every component's state as ``/status`` and as scrape-time metrics. The engine's
observers are built before the engine (:class:`~extauthz.observe.setup.Observability`);
nothing here rewires the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from .. import __version__
from ..clock import Clock
from ..engine import Engine
from ..observe.edge_metrics import EdgeCollector
from ..observe.setup import Observability
from ..observe.shadow import read_report
from ..observe.state import (
    AccessLogPart,
    FailOpenPart,
    GrantsPart,
    LeaseSampler,
    ModesPart,
    OverloadPart,
    Panel,
    PolicyPart,
    ReleasesPart,
    ReloadPart,
    Section,
    ShadowPart,
    ShedPart,
    StorePart,
    UncheckedPart,
    by_label_part,
    classifier_part,
    count_part,
)
from ..overload import LoopLag
from ..policy import Policy
from ..reload import PolicyWatcher
from ..runner import Runner
from ..settings import Settings, off
from ..store.base import Store
from ..tickets import REASONS as REJECT_REASONS
from .admin import admin_app
from .fleetstate import FleetState
from .opsports import OperatorPorts
from .services import AccessLogService, AuthorizationService
from .tls import CertificateReloader
from .traced import check_flow

log = logging.getLogger("extauthz.server")


#: how often the shadow recorder flushes and the lease sampler samples (seconds)
SHADOW_FLUSH_INTERVAL = 1.0
LEASES_SAMPLE_INTERVAL = 2.0


class Operations:
    """What operators see and change at run time, built from the one ``settings`` object
    and the server's built dependencies. ``watch``: reload the policy files of
    ``settings.policies`` (off when the server was given a policy object)."""

    def __init__(self, settings: Settings, *, engine: Engine, store: Store, clock: Clock,
                 observe: Observability, accesslog: AccessLogService, runner: Runner,
                 watch: bool = True, after_reload: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.store = store
        self.keys = engine.keys
        self.clock = clock
        self.observe = observe
        self.accesslog = accesslog
        self.runner = runner
        self.after_reload = after_reload
        #: the loop's lag (a Runner job) and the check budget (extauthz/overload.py); real
        #: time, whatever clock the limiters run on
        self.lag = LoopLag(settings.check_budget_ms / 1000.0, running=lambda: runner.running("loop_lag"))
        #: the admin and metrics ports, and the admin port's lock
        self.ports = OperatorPorts(
            [x for x in (off(settings.listen), off(settings.http_listen)) if x is not None],
            settings.admin_listen, settings.metrics_listen, admin_optional=settings.admin_listen_optional,
            admin_token_file=settings.admin_token_file, admin_hosts=settings.admin_hosts)
        self.admin_listen = self.ports.admin_listen
        #: the gRPC port's certificate reloader when TLS is on (set by the server).
        self.tls: CertificateReloader | None = None

        self.shadow_flush_interval = SHADOW_FLUSH_INTERVAL
        #: switches, overrides, their rules and the change log (server/fleetstate.py)
        self.fleet = FleetState(engine, store, self.keys, clock, interval=settings.switch_poll_interval)
        self.switches = self.fleet.switches
        self.overrides = self.fleet.overrides
        self.changes = self.fleet.changes
        self.watcher = (PolicyWatcher(settings.policies, self._apply_policy, current=engine.snapshot.policy,
                                      interval=settings.reload_interval, clock=clock,
                                      max_bytes=settings.policy_max_bytes)
                        if watch and settings.policies and settings.reload_interval > 0 else None)
        #: the Check servicer (its bad-request count is exported)
        self.auth = self._auth_service()
        self.leases: LeaseSampler | None = (LeaseSampler(engine, LEASES_SAMPLE_INTERVAL)
                                            if observe.metrics is not None else None)
        #: more sections of /status, by name (e.g. "http": the HTTP authorization port)
        self.status_sections: dict[str, Callable[[], Any]] = {}
        #: /status and the scrape-time metrics, one part per component
        self.panel = self._panel()
        if observe.metrics is not None:
            observe.metrics.registry.register(self.panel)
            observe.metrics.registry.register(EdgeCollector(
                lambda: self.tls, lambda: accesslog.rejected, REJECT_REASONS))

    def _panel(self) -> Panel:
        """The parts of /status and /metrics, in /status order. A component with state of
        its own adds its part here (or later with ``self.panel.add``)."""
        engine, observe, runner = self.engine, self.observe, self.runner
        metrics = observe.metrics
        return Panel([
            Section(lambda: {"extauthz": __version__}),
            PolicyPart(engine),
            ReloadPart(engine, self.watcher),
            StorePart(engine),
            Section(lambda: {"checks": metrics.request_counts() if metrics is not None else None}),
            FailOpenPart(engine),
            UncheckedPart(self.accesslog.finished),
            OverloadPart(self.lag),
            count_part("bad_requests", "extauthz_bad_requests", "CheckRequests the edge could not "
                       "read (answered allowed).", lambda: self.auth.flow.bad_requests),
            by_label_part("background_errors", "extauthz_background_errors", "Background job runs "
                          "that raised (the job keeps running), by job.", "job", lambda: runner.errors),
            ModesPart(engine),
            self.fleet,
            ShedPart(engine),
            self.leases if self.leases is not None else Section(lambda: {"leases_in_flight": None}),
            AccessLogPart(self.accesslog),
            ReleasesPart(engine),
            ShadowPart(observe.shadow),
            Section(lambda: {
                "decision_log": {"written": observe.decision_log.written,
                                 "suppressed": observe.decision_log.suppressed_total},
                "observer_errors": observe.observers.errors,
                "tracing": observe.tracing is not None,
                "tls": self.tls.status() if self.tls is not None else {"enabled": False},
                **self.ports.status(),
                "changes": self.changes.status(),
                "change_log_errors": self.changes.errors,
                **{name: section() for name, section in self.status_sections.items()}}),
            GrantsPart(engine),  # batched grants (was the first of status_sections)
            classifier_part(engine),
        ])

    def _apply_policy(self, policy: Policy) -> None:
        self.engine.set_policy(policy)
        self.observe.policy_changed(policy)
        if self.after_reload is not None:
            self.after_reload()

    def _auth_service(self) -> AuthorizationService:
        # the check flow of both front doors shares the access log's lease owner
        tracing, metrics = self.observe.tracing, self.observe.metrics
        return AuthorizationService(check_flow(self.engine, self.accesslog.leases,
                                               tracing.tracer if tracing is not None else None,
                                               self.lag, metrics.durations if metrics is not None else None))

    def auth_service(self) -> AuthorizationService:
        return self.auth

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        # serve with the fleet's switches and overrides from the first check
        await self.fleet.poll()
        try:
            await self.ports.start(lambda guard: admin_app(self, guard),
                                   self.observe.metrics.registry if self.observe.metrics is not None else None)
        except BaseException:
            await self.stop()
            raise
        run = self.runner.every
        # one poll of what operators change at run time: kill switches and overrides
        run("loop_lag", self.lag.interval, self.lag.tick, first=True)
        run("switch_poll", self.fleet.interval, self.fleet.poll)
        run("shadow_flush", self.shadow_flush_interval, self.observe.housekeeping)
        if self.watcher is not None:
            run("policy_reload", self.watcher.interval, self.watcher.poll)
        if self.leases is not None:
            run("lease_sampler", self.leases.interval, self.leases.sample_once, first=True)
        log.info("admin on port %s, metrics on port %s, tracing %s", self.admin_port or "off",
                 self.metrics_port or "off", "on" if self.observe.tracing else "off",
                 extra={"fields": {"event": "operations_started", "admin_port": self.admin_port,
                                   "metrics_port": self.metrics_port,
                                   "tracing": self.observe.tracing is not None,
                                   "reload": self.watcher is not None}})

    @property
    def admin_port(self) -> int:
        return self.ports.admin_port

    @property
    def metrics_port(self) -> int:
        return self.ports.metrics_port

    async def stop(self) -> None:
        await self.runner.stop()
        await self.observe.stop()
        await self.ports.stop()

    # -- what the admin port reads and changes (AdminBackend) -------------------------------
    def status(self) -> dict[str, Any]:
        return self.panel.status()

    def limiter_names(self) -> set[str]:
        return self.fleet.limiter_names()

    def switch_status(self) -> dict[str, Any]:
        return self.fleet.switch_status()

    def override_rows(self) -> dict[str, Any]:
        return self.fleet.override_rows()

    async def set_override(self, limiter: str, identity: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.fleet.set_override(limiter, identity, body)

    async def clear_override(self, limiter: str, identity: str) -> bool:
        return await self.fleet.clear_override(limiter, identity)

    async def customer(self, identity: str, plan: str | None = None) -> dict[str, Any]:
        """One customer's limiters, live counters, the grants this replica holds and its
        recent refusals here (``GET /customers/<hash>``; :mod:`extauthz.inspect`)."""
        from ..inspect import customer_view, held_grants

        snap = self.engine.snapshot
        wall = self.clock.wall()
        view = await customer_view(identity, policy=snap.policy, limiters=snap.limiters, store=self.store,
                                   keys=self.keys, overrides=self.engine.overrides,
                                   switches=snap.switches, wall=wall, plan=plan)
        held_grants(view, snap.limiters, self.keys, wall)
        refusals = self.observe.refusals
        view["recent_refusals"] = {**refusals.describe(), "refusals": refusals.of(identity)}
        return view

    async def shadow_report(self, window: float, *, top: int = 10) -> dict[str, Any]:
        await self.observe.shadow.flush()  # include what this replica noted in the last second
        return await read_report(self.store, self.keys.shadow_log, window, now=self.clock.wall(), top=top)
