"""Build every dependency in one place and run the servers.

:class:`Server` is what ``extauthz serve`` runs and what the tests start in-process.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.portfile import remove_admin_url, write_admin_url
from ..core.runner import Runner
from ..core.settings import Settings, event_loop, off
from ..engine.engine import Engine
from ..engine.overload import LoopLag
from ..engine.quota_service import (
    QuotaBook,
    QuotaLimit,
    StoreLedger,
    classification_id,
    envoy_sheds,
    limits_of,
)
from ..engine.reload import PolicyWatcher
from ..engine.state import LeaseSampler, RecorderPart, Section, by_label_part
from ..engine.storegate import StoreGate
from ..engine.tickets import REASONS as REJECT_REASONS
from ..engine.tickets import LeaseTickets
from ..envoy.headers import unreadable_over_http
from ..limiters.worker import sampler_job
from ..observe import compose
from ..observe.edge_metrics import EdgeCollector
from ..observe.record import Recorder, pending_ttl
from ..observe.setup import Observability
from ..policy import Policy, load_policy
from ..proto import accesslog_pb2_grpc, auth_pb2_grpc, rlqs_pb2_grpc, rls_pb2_grpc
from ..store.base import Store
from ..store.keys import Keys
from ..store.memory import MemoryStore
from .admin import admin_app
from .fleetstate import FleetState, ReplicaControl
from .fluentd import FluentdReceiver
from .grpc_h2 import GrpcH2Server, H2Limits
from .http import HttpAuthorization, HttpLimits, max_connections_for
from .leases import Leases
from .opsports import OperatorPorts
from .panel import status_panel
from .ports import parse_listen
from .rls import detailed_part
from .services import (
    AccessLogService,
    AuthorizationService,
    RateLimitQuotaService,
    RateLimitService,
    quota_metrics,
)
from .tls import CertificateReloader, TlsFiles
from .traced import check_flow

log = logging.getLogger("extauthz.server")

AUTH_SERVICE = "envoy.service.auth.v3.Authorization"
ACCESSLOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
#: how often the shadow recorder flushes and the lease sampler samples (seconds)
SHADOW_FLUSH_INTERVAL = 1.0
LEASES_SAMPLE_INTERVAL = 2.0


#: the server's configuration: one :class:`~extauthz.core.settings.Settings`, every option declared
#: once there (flag, variable, default, help) and built from the command line by
#: :func:`extauthz.core.settings.from_args`.
ServerConfig = Settings


def stop_budget(grace: float, close_linger: float = H2Limits.close_linger) -> float:
    """The longest a graceful stop takes after SIGTERM (s): the ports' grace (all at once),
    the event-loop gRPC port's ``close_linger`` after it (clients close their answered
    streams, then their connections), and the release drain (``grace``, at least 1 s). The
    chart's ``terminationGracePeriodSeconds`` must exceed its preStop sleep plus this
    (helm/extauthz/values.yaml; tests/helm/test_chart.py renders both)."""
    return grace + close_linger + max(grace, 1.0)


def is_off(listen: str | None) -> bool:
    """An off listen value (unset, ``""``, ``off``, ``none``: :func:`extauthz.core.settings.off`)."""
    return off(listen) is None


def _bind(server: grpc.aio.Server, listen: str, flag: str,
          credentials: grpc.ServerCredentials | None) -> int:
    try:
        port = (server.add_insecure_port(listen) if credentials is None
                else server.add_secure_port(listen, credentials))
    except RuntimeError:  # grpc's "Failed to bind to address"
        port = 0
    if port == 0:
        raise OSError(errno.EADDRINUSE, f"cannot listen on {listen} ({flag}): the address is taken or not available")
    return int(port)


def make_store(config: ServerConfig, clock: Clock = SYSTEM_CLOCK) -> Store:
    if not config.redis_url:
        return MemoryStore(clock, max_keys=config.memory_max_keys)
    from ..store.redis import RedisStore  # imported only when Redis is asked for

    return RedisStore.from_url(config.redis_url, deadline=config.store_deadline_ms / 1000.0)


class Server:
    def __init__(self, config: ServerConfig, *, policy: Policy | None = None,
                 store: Store | None = None, clock: Clock = SYSTEM_CLOCK,
                 tracer_provider: Any = None) -> None:
        self.config = config
        self.clock = clock
        self.policy = policy if policy is not None else load_policy(config.policies, max_bytes=config.policy_max_bytes)
        self.store = store if store is not None else make_store(config, clock)
        keys = Keys(config.key_prefix)
        # The engine's observers and store-call wrapper first: the engine gets them at
        # construction (tracing from OTEL_* unless given; metrics when a port is asked for).
        self.observe = Observability(
            store=self.store, keys=keys, clock=clock, policy=self.policy,
            metrics=off(config.metrics_listen) is not None,
            decision_log_per_second=config.decision_log_per_second, tracer_provider=tracer_provider)
        observer = self.observe.observer
        self.recorder: Recorder | None = None
        if config.record_dir:  # serve --record: one more observer, fed durations by the access log
            self.recorder = Recorder(config.record_dir, max_bytes=config.record_max_bytes,
                                     sample=config.record_sample, clock=clock,
                                     redact_paths=config.record_paths != "raw",
                                     pending_ttl=pending_ttl(self.policy))
            observer = compose([observer, self.recorder])
        gate = StoreGate(self.store, config.store_deadline_ms / 1000.0, clock=clock,
                         store_check=self.observe.store_check)
        self.engine = Engine(gate, self.policy, keys=keys, salt=config.identity_salt.encode(), observer=observer)
        #: every background loop (switch poll, reload, shadow flush, samplers)
        self.runner = Runner()
        self.health = health.aio.HealthServicer()
        self.accesslog = AccessLogService(
            Leases(self.engine, tickets=LeaseTickets(keys, config.lease_secret)),
            on_finished=self.recorder.finished if self.recorder is not None else None)
        #: the rate limit quota stream (RLQS, docs/rlqs.md), on the gRPC port
        self._quota_for: Policy | None = None
        self._quota_cache: Mapping[str, QuotaLimit] = {}
        # the store's ledger spans replicas; the embedded store is one replica's (and starts
        # empty with it): this replica's ledger is the whole ledger there
        ledger = None if isinstance(self.store, MemoryStore) else StoreLedger(self.store, keys)
        self.quota = RateLimitQuotaService(QuotaBook(self._quota_limits, clock=clock,
                                                     salt=config.identity_salt.encode(),
                                                     confirm_on_write=True, ledger=ledger,
                                                     sheds=lambda: envoy_sheds(self.engine.snapshot.active),
                                                     classification=lambda: classification_id(
                                                         self.engine.snapshot.policy)))
        if not config.lease_secret and config.redis_url:
            log.warning("no --lease-secret: lease tickets use a random per-process key, so with several "
                        "replicas an access-log entry reaching another replica releases nothing (its "
                        "leases wait for their TTL); give every replica the same --lease-secret",
                        extra={"fields": {"event": "lease_secret_random"}})
        # What operators see and change at run time, each owner built here once:
        #: the loop's lag (a Runner job) and the check budget (extauthz/engine/overload.py); real
        #: time, whatever clock the limiters run on
        self.lag = LoopLag(config.check_budget_ms / 1000.0, running=lambda: self.runner.running("loop_lag"))
        #: the admin and metrics ports, and the admin port's lock
        self.ports = OperatorPorts.from_settings(config)
        #: switches, overrides and the change log (server/fleetstate.py)
        self.fleet = FleetState(self.engine, self.store, keys, clock, interval=config.switch_poll_interval)
        #: hot reload of --policies (off when the server was given a policy object)
        self.watcher = (PolicyWatcher(config.policies, self.apply_policy, current=self.policy,
                                      interval=config.reload_interval, clock=clock,
                                      max_bytes=config.policy_max_bytes)
                        if policy is None and config.policies and config.reload_interval > 0 else None)
        #: the Check servicer of both front doors: one check flow, sharing the access log's
        #: lease owner (request-id index, ticket key) and one bad-request count
        tracing, metrics = self.observe.tracing, self.observe.metrics
        self.auth = AuthorizationService(check_flow(self.engine, self.accesslog.leases,
                                                    tracing.tracer if tracing is not None else None,
                                                    self.lag, metrics.durations if metrics is not None else None))
        #: ShouldRateLimit (Envoy's ratelimit filter, docs/migrating.md) on the same check flow
        self.ratelimit = RateLimitService(self.auth.flow)
        self.leases: LeaseSampler | None = (LeaseSampler(self.engine, LEASES_SAMPLE_INTERVAL)
                                            if metrics is not None else None)
        files = TlsFiles.from_options(config.tls_cert, config.tls_key, config.tls_client_ca)
        self.tls = CertificateReloader(files) if files is not None else None
        #: more sections of /status, by name (e.g. "http": the HTTP authorization port)
        self.status_sections: dict[str, Callable[[], Any]] = {}
        #: /status and the scrape-time metrics, one part per component (server/panel.py)
        self.panel = status_panel(self)
        self.panel.add(RecorderPart(self.recorder))  # /status recorder, extauthz_recorder_*
        self.panel.add(by_label_part(
            "ratelimit_descriptors", "extauthz_ratelimit_descriptors", "Rate limit descriptors "
            "(ShouldRateLimit) by what answered them: decided (a limiter), replaced (its limiter "
            "switched off by another's replaces), unknown (none matched: allowed), unlimited.",
            "result", self.ratelimit.door.counts))
        self.panel.add(by_label_part(
            "ratelimit_limit_overrides", "extauthz_ratelimit_limit_overrides", "Rate limit descriptors' "
            "own limit (Envoy's override): applied (a quota of its unit) or ignored (the policy decides).",
            "result", lambda: dict(self.ratelimit.door.overrides)))
        self.panel.add(detailed_part(self.ratelimit.door))
        self.panel.add(Section(lambda: {"quota": self.quota.book.status()},  # extauthz_quota_*
                               partial(quota_metrics, self.quota.book)))
        if metrics is not None:
            metrics.registry.register(self.panel)
            metrics.registry.register(EdgeCollector(lambda: self.tls, lambda: self.accesslog.rejected,
                                                    REJECT_REASONS))
        #: what the admin routes read and change: the one control path (extauthz/control/control.py)
        self.control = ReplicaControl(self.fleet, observe=self.observe, status=self.panel.status)
        if is_off(config.listen) and is_off(config.http_listen):
            raise ValueError("both the gRPC (--listen) and the HTTP (--http-listen) ports are off: "
                             "nothing to serve")
        self.grpc: grpc.aio.Server | GrpcH2Server | None = None
        self.health_grpc: grpc.aio.Server | GrpcH2Server | None = None
        self.http: HttpAuthorization | None = None
        self.fluentd: FluentdReceiver | None = None
        self.fluentd_port = 0
        #: the gRPC port (0 when off) and the HTTP authorization port (0 when off).
        self.port = 0
        self.http_port = 0
        self.health_port = 0

    def _http_max_connections(self) -> int:
        derived = max_connections_for()
        asked = self.config.http_max_connections
        if asked is None:
            return derived
        if asked > derived:
            log.warning("--http-max-connections %d is above what the file limit leaves (%d): idle "
                        "connections can exhaust descriptors the admin port, Redis and policy "
                        "reloads need; raise the limit (ulimit -n)", asked, derived,
                        extra={"fields": {"event": "http_max_connections_above_file_limit",
                                          "asked": asked, "derived": derived}})
        return asked

    def apply_policy(self, policy: Policy) -> None:
        """A reloaded policy: the engine's, the observers', the samplers' and the HTTP port's."""
        self.engine.set_policy(policy)
        self.observe.policy_changed(policy)
        self._policy_applied()

    async def _start_operations(self) -> None:
        """The fleet's switches and overrides read, the admin and metrics ports up, and the
        background jobs on the runner."""
        # serve with the fleet's switches and overrides from the first check
        await self.fleet.poll()
        try:
            await self.ports.start(lambda guard: admin_app(self.control, guard),
                                   self.observe.metrics.registry if self.observe.metrics is not None else None)
        except BaseException:
            await self._stop_operations()
            raise
        run = self.runner.every
        # one poll of what operators change at run time: kill switches and overrides
        run("loop_lag", self.lag.interval, self.lag.tick, first=True)
        run("switch_poll", self.fleet.interval, self.fleet.poll)
        run("shadow_flush", SHADOW_FLUSH_INTERVAL, self.observe.housekeeping)
        if self.watcher is not None:
            run("policy_reload", self.watcher.interval, self.watcher.poll)
        if self.leases is not None:
            run("lease_sampler", self.leases.interval, self.leases.sample_once, first=True)
        admin_port, metrics_port = self.ports.admin_port, self.ports.metrics_port
        log.info("admin on port %s, metrics on port %s, tracing %s", admin_port or "off",
                 metrics_port or "off", "on" if self.observe.tracing else "off",
                 extra={"fields": {"event": "operations_started", "admin_port": admin_port,
                                   "metrics_port": metrics_port, "tracing": self.observe.tracing is not None,
                                   "reload": self.watcher is not None}})

    async def _stop_operations(self) -> None:
        await self.runner.stop()
        await self.observe.stop()
        await self.ports.stop()

    async def start(self) -> int:
        await self._start_operations()
        service = self.auth
        server: grpc.aio.Server | None = None
        try:
            if not is_off(self.config.http_listen):
                assert self.config.http_listen is not None
                self.http = HttpAuthorization(
                    service.flow, HttpLimits(header_timeout=self.config.http_header_timeout,
                                        max_active_checks=self.config.http_max_active_checks,
                                        max_connections=self._http_max_connections()),
                    forward_auth=self.config.http_forward_auth, prefix=self.config.http_path_prefix)
                self.http_port = await self.http.start(self.config.http_listen,
                                                       reuse_port=self.config.reuse_port)
                self.status_sections["http"] = self.http.status
            if not is_off(self.config.fluentd_listen):
                assert self.config.fluentd_listen is not None
                self.fluentd = FluentdReceiver(self.accesslog.finished)
                self.fluentd_port = await self.fluentd.start(self.config.fluentd_listen,
                                                             reuse_port=self.config.reuse_port)
                self.status_sections["fluentd"] = self.fluentd.status
            limits = self.config.grpc_limits or H2Limits(max_connections=max_connections_for())
            if isinstance(limits, dict):  # a worker's settings arrive as JSON (workers.py)
                limits = H2Limits(**limits)
            if not is_off(self.config.listen) and self.config.grpc_server == "asyncio":
                # the same servicers on HTTP/2 served by the event loop (server/grpc_h2.py)
                # its connection bound follows the file limit, as the HTTP port's does
                h2server = GrpcH2Server(limits, ssl_context=self.tls.ssl_context() if self.tls is not None else None)
                auth_pb2_grpc.add_AuthorizationServicer_to_server(service, h2server)
                accesslog_pb2_grpc.add_AccessLogServiceServicer_to_server(self.accesslog, h2server)
                rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(self.quota, h2server)
                rls_pb2_grpc.add_RateLimitServiceServicer_to_server(self.ratelimit, h2server)
                health_pb2_grpc.add_HealthServicer_to_server(self.health, h2server)
                self.port = await h2server.start(self.config.listen, reuse_port=self.config.reuse_port,
                                                 flag="--listen")
                self.grpc = h2server
                self.status_sections["grpc"] = h2server.status
                self.panel.add(Section(metrics=h2server.metrics))  # extauthz_grpc_*
            elif not is_off(self.config.listen):
                server = grpc.aio.server(options=[("grpc.so_reuseport", int(self.config.reuse_port))])
                auth_pb2_grpc.add_AuthorizationServicer_to_server(service, server)
                accesslog_pb2_grpc.add_AccessLogServiceServicer_to_server(self.accesslog, server)
                rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(self.quota, server)
                rls_pb2_grpc.add_RateLimitServiceServicer_to_server(self.ratelimit, server)
                health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
                self.port = _bind(server, self.config.listen, "--listen",
                                  self.tls.credentials() if self.tls is not None else None)
            if not is_off(self.config.health_listen) and self.config.grpc_server == "asyncio":
                # plaintext, health only (the kubelet's probes), on the same server kind
                assert self.config.health_listen is not None
                h2health = GrpcH2Server(limits)
                health_pb2_grpc.add_HealthServicer_to_server(self.health, h2health)
                self.health_grpc = h2health
                self.health_port = await h2health.start(self.config.health_listen,
                                                        reuse_port=self.config.reuse_port, flag="--health-listen")
            elif not is_off(self.config.health_listen):
                assert self.config.health_listen is not None
                health_server = grpc.aio.server(options=[("grpc.so_reuseport", int(self.config.reuse_port))])
                health_pb2_grpc.add_HealthServicer_to_server(self.health, health_server)
                self.health_port = _bind(health_server, self.config.health_listen, "--health-listen", None)
                await health_server.start()
                self.health_grpc = health_server
        except BaseException:
            if self.grpc is not None:
                await self.grpc.stop(0)
            if self.health_grpc is not None:
                await self.health_grpc.stop(0)
            if self.fluentd is not None:
                await self.fluentd.stop()
            if self.http is not None:
                await self.http.stop(0)
            await self._stop_operations()
            raise
        if server is not None:
            await server.start()
            self.grpc = server
        for name in ("", AUTH_SERVICE, ACCESSLOG_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._policy_applied()
        if self.recorder is not None:
            self.runner.every("recorder", self.recorder.flush_interval, self.recorder.flush)
        self._write_admin_url()
        log.info("serving on port %s (%s) with policy %s (%s store); HTTP authorization on port %s",
                 self.port or "off", "plaintext" if self.tls is None else ("mTLS" if self.tls.mtls else "TLS"),
                 self.policy.version, self.store.name, self.http_port or "off",
                 extra={"fields": {"event": "serving", "grpc_port": self.port, "http_port": self.http_port,
                                   "fluentd_port": self.fluentd_port}})
        return self.port or self.http_port

    @property
    def admin_url(self) -> str | None:
        if not self.ports.admin_port or self.ports.admin_listen is None:
            return None
        host = parse_listen(self.ports.admin_listen)[0]
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.ports.admin_port}"

    def _write_admin_url(self) -> None:
        if not self.config.admin_url_file or self.admin_url is None:
            return
        try:
            write_admin_url(Path(self.config.admin_url_file), self.admin_url)
        except OSError as exc:
            log.warning("cannot write the admin URL file: %s", exc)

    def _quota_limits(self) -> Mapping[str, QuotaLimit]:
        """The quota stream's limiters, from the policy in force (computed once per policy)."""
        policy = self.engine.snapshot.policy
        if self._quota_for is not policy:
            self._quota_for, self._quota_cache = policy, limits_of(policy)
        return self._quota_cache

    def _policy_applied(self) -> None:
        """At start and after each reload: the samplers follow the policy, and the HTTP port
        says what of the policy its protocol cannot carry."""
        self.sync_samplers()
        if self.http is not None:
            for problem in unreadable_over_http(self.engine.snapshot.policy):
                log.warning("HTTP authorization port: %s", problem,
                            extra={"fields": {"event": "http_unreadable", "problem": problem}})

    def sync_samplers(self) -> None:
        """One sampler job per worker utilization shedder of the current policy; call
        again after a policy reload (a sampler whose shedder is gone ends by itself)."""
        for shedder in self.engine.snapshot.workers:
            interval, tick = sampler_job(self.engine, shedder.name)
            self.runner.every(f"sampler:{shedder.name}", interval, tick, first=True)

    def stop_budget(self, grace: float | None = None) -> float:
        """The longest :meth:`stop` takes (s) with this grace (default the configured one)."""
        linger = max((s.limits.close_linger for s in (self.grpc, self.health_grpc)
                      if isinstance(s, GrpcH2Server)), default=0.0)
        return stop_budget(self.config.grace_seconds if grace is None else grace, linger)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop: NOT_SERVING first, let in-flight calls finish on every port at once
        (up to ``grace`` s, the configured grace by default), then drain the releases with what
        is left of :meth:`stop_budget`, and close."""
        grace = self.config.grace_seconds if grace is None else grace
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_budget(grace)
        await self.health.enter_graceful_shutdown()
        await self.runner.stop()
        # The ports' graces run at once, not one after the other: in turn they came to about
        # 22 s with the preStop sleep, past the chart's terminationGracePeriodSeconds (20 s).
        doors: list[Any] = []
        if self.http is not None:
            doors.append(self.http.stop(grace))
        if self.grpc is not None:
            doors.append(self.grpc.stop(grace))
        if self.health_grpc is not None:
            doors.append(self.health_grpc.stop(0))
        await asyncio.gather(*doors)
        if self.fluentd is not None:  # after the front doors: the last entries still release
            await self.fluentd.stop(within=max(0.0, deadline - loop.time()))  # within the budget
        await self._stop_operations()
        if self.config.admin_url_file and self.admin_url is not None:
            remove_admin_url(Path(self.config.admin_url_file), self.admin_url)
        if self.recorder is not None:  # what finished, and what still waits (no duration)
            await self.recorder.close()
        # Batched grants still held go back; releases still on their way (access log,
        # cancelled Checks, late store answers) finish before the store closes, within what
        # is left of the budget.
        await self.engine.settle_grants()
        await self.engine.releaser.drain(min(max(grace, 1.0), max(0.5, deadline - loop.time())))
        await self.store.close()

    async def wait(self) -> None:
        if self.grpc is not None:
            await self.grpc.wait_for_termination()
        elif self.http is not None and self.http.server is not None:
            await self.http.server.wait_closed()


async def run(config: ServerConfig, on_ready: Callable[[int], None] | None = None) -> None:
    server = Server(config)
    await server.start()
    # What startup built (modules, the policy, protobuf, gRPC and OpenTelemetry objects) lives
    # as long as the process: frozen out of the collector's reach, a full collection scans only
    # what serving allocated. Unfrozen, each one walked every object of the process: a 37-45 ms
    # pause every few seconds under load, the loop stalled and the p99 with it (docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if on_ready is not None:
        on_ready(server.port or server.http_port)
    await stopping.wait()
    budget = server.stop_budget()
    log.info("stopping: health NOT_SERVING, finishing in-flight calls within %.1f s", budget,
             extra={"fields": {"event": "stopping", "budget_seconds": budget}})
    await server.stop()


def serve(config: ServerConfig, on_ready: Callable[[int], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT. uvloop unless ``EXTAUTHZ_EVENT_LOOP=asyncio`` (measured in
    docs/benchmarks.md: uvloop is the faster of the two here)."""
    if event_loop() != "asyncio":
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            pass
        else:
            uvloop.run(run(config, on_ready))
            return
    asyncio.run(run(config, on_ready))

