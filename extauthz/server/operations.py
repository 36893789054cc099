"""Safe rollout and observability, built once for a :class:`~extauthz.server.app.Server`.

One object owns the engine's observers (metrics, decision log, shadow recorder, tracing),
the store-call instrumentation, the admin and metrics ports and the background jobs (policy
reload, switch poll, shadow flush, lease sampling, log summaries): built with the server's
dependencies in its constructor, started and stopped with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from .. import __version__
from ..clock import Clock
from ..engine import Engine, Observer
from ..observe import compose
from ..observe.logs import DecisionLog
from ..observe.metrics import LeaseSampler, Metrics, StateCollector, instrument_store_check
from ..observe.shadow import ShadowRecorder, read_report
from ..observe.tracing import Tracing, TracingObserver, provider_from_env
from ..policy import Policy
from ..release import releases_status
from ..reload import PolicyWatcher
from ..runner import Runner
from ..store.base import Store
from ..store.keys import Keys
from ..store.memory import MemoryStore
from ..switches import SwitchBoard
from ..verdict import Mode
from .admin import admin_app, metrics_app, parse_listen, start_http
from .services import AccessLogService, AuthorizationService

log = logging.getLogger("extauthz.server")

OFF = ("", "off", "none")


class Operations:
    def __init__(self, *, engine: Engine, store: Store, keys: Keys, clock: Clock,
                 accesslog: AccessLogService, listen: str, admin_listen: str | None,
                 metrics_listen: str | None, watch: Sequence[str | Path] | None,
                 reload_interval: float = 1.0, switch_poll_interval: float = 1.0,
                 shadow_flush_interval: float = 1.0, leases_sample_interval: float = 2.0,
                 decision_log_per_second: int = 1000, tracer_provider: Any = None,
                 after_reload: Callable[[], None] | None = None,
                 runner: Runner | None = None) -> None:
        self.engine = engine
        self.store = store
        self.keys = keys
        self.clock = clock
        self.accesslog = accesslog
        self.after_reload = after_reload
        self.runner = runner if runner is not None else Runner()
        self.admin_listen = None if (admin_listen or "").lower() in OFF else admin_listen
        self.metrics_listen = None if (metrics_listen or "").lower() in OFF else metrics_listen
        for what, where in (("admin", self.admin_listen), ("metrics", self.metrics_listen)):
            if where is not None and parse_listen(where)[1] != 0 and \
                    parse_listen(where)[1] == parse_listen(listen)[1]:
                raise ValueError(f"the {what} port must not be the public Check port ({listen})")

        provider = tracer_provider if tracer_provider is not None else provider_from_env()
        self.tracing = Tracing(provider) if provider is not None else None
        #: the Check servicer (its bad-request count is exported)
        self.auth = self._auth_service()
        self.decision_log = DecisionLog(max_per_second=decision_log_per_second, clock=clock)
        self.shadow = ShadowRecorder(store, keys.shadow_log, clock=clock)
        self.shadow_flush_interval = shadow_flush_interval
        self.switches = SwitchBoard(store, keys.switches, engine.set_switches, interval=switch_poll_interval)
        self.watcher = (PolicyWatcher(watch, self._apply_policy, current=engine.snapshot.policy,
                                      interval=reload_interval, clock=clock)
                        if watch and reload_interval > 0 else None)

        self.metrics: Metrics | None = None
        self.leases: LeaseSampler | None = None
        observers: list[Observer] = []
        if self.metrics_listen is not None:
            self.metrics = Metrics()
            self.metrics.prime(engine.snapshot.policy)
            self.leases = LeaseSampler(engine, leases_sample_interval)
            self.metrics.registry.register(StateCollector(
                engine, accesslog=accesslog, reload=self.watcher, leases=self.leases,
                shadow_dropped=lambda: self.shadow.dropped,
                background_errors=lambda: self.runner.errors,
                bad_requests=lambda: self.auth.bad_requests))
            observers.append(self.metrics)
        observers += [self.decision_log, self.shadow]
        if self.tracing is not None:
            observers.append(TracingObserver())
        self.observer = compose(observers)
        engine.observer = self.observer
        engine.store_check = instrument_store_check(
            engine.store_check, histogram=self.metrics.store_call if self.metrics else None,
            tracer=self.tracing.tracer if self.tracing else None, store_name=store.name)

        self.admin_port = 0
        self.metrics_port = 0
        self._runners: list[web.AppRunner] = []

    def _apply_policy(self, policy: Policy) -> None:
        self.engine.set_policy(policy)
        if self.metrics is not None:
            self.metrics.prime(policy)
        if self.after_reload is not None:
            self.after_reload()

    def _auth_service(self) -> AuthorizationService:
        # shares the access log's request-id index (leases whose answer Envoy dropped)
        if self.tracing is None:
            return AuthorizationService(self.engine, self.accesslog.index)
        from .traced import TracedAuthorizationService

        return TracedAuthorizationService(self.engine, self.tracing.tracer, self.accesslog.index)

    def auth_service(self) -> AuthorizationService:
        return self.auth

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.switches.poll_once()  # serve with the fleet's switches from the first check
        try:
            if self.metrics is not None and self.metrics_listen is not None:
                runner, self.metrics_port = await start_http(metrics_app(self.metrics.registry),
                                                             self.metrics_listen)
                self._runners.append(runner)
            if self.admin_listen is not None:
                runner, self.admin_port = await start_http(admin_app(self), self.admin_listen)
                self._runners.append(runner)
                host = parse_listen(self.admin_listen)[0]
                if host not in ("127.0.0.1", "localhost", "::1"):
                    log.warning("the admin port listens on %s: it changes kill switches without "
                                "authentication; keep it private", self.admin_listen,
                                extra={"fields": {"event": "admin_not_loopback"}})
        except BaseException:
            await self.stop()
            raise
        run = self.runner.every
        run("switch_poll", self.switches.interval, self.switches.poll_once)
        run("shadow_flush", self.shadow_flush_interval, self._housekeeping)
        if self.watcher is not None:
            run("policy_reload", self.watcher.interval, self.watcher.poll_once)
        if self.leases is not None:
            run("lease_sampler", self.leases.interval, self.leases.sample_once, first=True)
        log.info("admin on port %s, metrics on port %s, tracing %s", self.admin_port or "off",
                 self.metrics_port or "off", "on" if self.tracing else "off",
                 extra={"fields": {"event": "operations_started", "admin_port": self.admin_port,
                                   "metrics_port": self.metrics_port, "tracing": self.tracing is not None,
                                   "reload": self.watcher is not None}})

    async def _housekeeping(self) -> None:
        self.decision_log.flush()
        await self.shadow.flush()

    async def stop(self) -> None:
        await self.runner.stop()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self.shadow.flush()
        self.decision_log.flush()
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
            self.tracing = None

    # -- status ---------------------------------------------------------------------------
    def limiter_names(self) -> set[str]:
        return {spec.name for spec in self.engine.snapshot.policy.limiters}

    def switch_status(self) -> dict[str, Any]:
        snap = self.engine.snapshot
        return {
            "switches": snap.switches.to_dict(),
            "limiters": {
                spec.name: {"type": spec.type, "policy_mode": spec.mode,
                            "mode": snap.switches.effective(spec.name, Mode(spec.mode)).value}
                for spec in snap.policy.limiters
            },
        }

    def status(self) -> dict[str, Any]:
        engine = self.engine
        snap = engine.snapshot
        policy = snap.policy
        reload = self.watcher.status() if self.watcher is not None else {
            "version": policy.version, "sources": list(policy.sources), "last_error": None,
            "failures": 0, "reloads": 0, "watching": []}
        return {
            "extauthz": __version__,
            "policy": {"version": policy.version, "sources": list(policy.sources)},
            "reload": reload,
            "store": {"name": self.store.name, "breaker": engine.breaker.state,
                      "window_failures": engine.breaker.failures,
                      **({"live_leases": self.store.live_leases()}
                         if isinstance(self.store, MemoryStore) else {})},
            "fail_open": dict(sorted(engine.failures.items())),
            "bad_requests": self.auth.bad_requests,
            "background_errors": dict(sorted(self.runner.errors.items())),
            **self.switch_status(),
            "switch_poll": {"errors": self.switches.errors, "updates": self.switches.updates},
            "shedding": [
                {"limiter": w.name, "level": w.level, "utilization": w.utilization,
                 "probabilities": {t.value: p for t, p in w.probabilities.items()}}
                for w in snap.workers
            ],
            "leases_in_flight": dict(self.leases.values) if self.leases is not None else None,
            "access_log": {"entries": self.accesslog.entries,
                           "awaiting_log": len(self.accesslog.index)},
            "lease_releases": releases_status(engine.releaser),
            "shadow": {"recorded": self.shadow.recorded, "flushed_events": self.shadow.flushed,
                       "pending": self.shadow.pending, "dropped": self.shadow.dropped},
            "decision_log": {"written": self.decision_log.written,
                             "suppressed": self.decision_log.suppressed_total},
            "observer_errors": getattr(self.observer, "errors", 0),
            "tracing": self.tracing is not None,
        }

    async def shadow_report(self, window: float, *, top: int = 10) -> dict[str, Any]:
        await self.shadow.flush()  # include what this replica noted in the last second
        return await read_report(self.store, self.keys.shadow_log, window, now=self.clock.wall(), top=top)
