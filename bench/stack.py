"""One configuration's running stack (Envoy, the server, Redis) and the counters and CPU
read from it around a measured run."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from extauthz.devtools.envoy_config import local_render
from extauthz.devtools.envoy_process import EnvoyProcess
from extauthz.devtools.stack import ServerProcess, free_port
from extauthz.engine.quota_service import REPORT_INTERVAL
from extauthz.envoy.config import GRPC_ACCESS_LOGGER, LocalRateLimit
from extauthz.envoy.ratelimit import bootstrap as ratelimit_bootstrap
from extauthz.policy import load_policy

from .configs import Options, Setup, policy_file
from .procs import RedisServer, children, cpu_seconds, established_by_pid, free_port_block
from .stats import Phase

ROOT = Path(__file__).resolve().parents[1]
#: the server's store counters read around a run (extauthz.observe.metrics)
STORE_COUNTERS = ("extauthz_store_round_trips_total", "extauthz_store_script_calls_total")
#: passed store deadlines by where the check was (``where`` label), read the same way
DEADLINE_MISSED = "extauthz_store_deadline_missed_total"
#: the key under which Stack.fail_open carries /status ``overload.checks`` (all tiers)
OVERLOAD_CHECKS = "overload_checks"


class Running:
    """Envoy (+ server) for one configuration; counters and CPU snapshots."""

    def __init__(self, setup: Setup, redis: RedisServer | None, opts: Options, workdir: Path) -> None:
        self.setup = setup
        self.redis = redis
        self.opts = opts
        self.workdir = workdir
        self.server: ServerProcess | None = None
        self.envoy: EnvoyProcess | None = None
        self.admin_base = 0
        self.metrics_base = 0
        self.http_port = 0
        self.fluentd_port = 0

    # -- lifecycle
    def start(self) -> Running:
        s = self.setup
        try:
            extauthz_port = free_port()
            if s.server:  # for ext_authz, or (rlqs) for the quota stream alone
                args = ["--store-deadline-ms", str(self.opts.deadline_ms)]
                if s.redis:
                    assert self.redis is not None
                    args += ["--redis-url", self.redis.url]
                if s.workers > 1:
                    args += ["--workers", str(s.workers), *(["--worker-ports"] if s.worker_ports else [])]
                # worker i serves admin on base + i: take a block of free ports
                self.admin_base = free_port_block(s.workers)
                args += ["--admin-listen", f"127.0.0.1:{self.admin_base}"]
                if s.redis:  # the store's round trips (worker i: base + i, as admin)
                    self.metrics_base = free_port_block(s.workers)
                    args += ["--metrics-listen", f"127.0.0.1:{self.metrics_base}"]
                args += s.server_args
                if s.protocol == "http":
                    self.http_port = free_port()
                    args += ["--http-listen", f"127.0.0.1:{self.http_port}"]
                if s.access_log == "fluentd":  # the release path through Envoy's fluentd logger
                    self.fluentd_port = free_port()
                    args += ["--fluentd-listen", f"127.0.0.1:{self.fluentd_port}"]
                env = {"EXTAUTHZ_EVENT_LOOP": s.loop, "PYTHONPATH": str(ROOT)}
                self.server = ServerProcess([policy_file(s)], args=args, env=env,
                                            workdir=self.workdir,
                                            port=free_port_block(s.workers) if s.worker_ports else None).start()
                if s.workers > 1:
                    self._wait_workers()
                extauthz_port = self.server.port
            self._start_envoy(extauthz_port)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_envoy(self, extauthz_port: int) -> None:
        self.envoy = EnvoyProcess(yaml.safe_dump(self._config(extauthz_port), sort_keys=False),
                                  concurrency=self.setup.envoy_concurrency).start()

    def _config(self, extauthz_port: int) -> dict[str, Any]:
        """What the generator (``extauthz envoy-config``) gives this setup's policy with the
        quick start's routes, Envoy answering ``200 ok`` itself, and the setup's variants."""
        s = self.setup
        options: dict[str, Any] = {
            "ext_authz": s.ext_authz, "tracing": None, "direct_response": True, "quickstart_routes": True,
            "authz_endpoints": s.workers if s.worker_ports else 1,
            "local_ratelimit": LocalRateLimit(max_tokens=1_000_000_000) if s.local_ratelimit else None,
            # what the policy reads, or (send_all_headers) every header, as Envoy does unlisted
            "send_all_headers": s.send_all_headers,
            # always, auto (only when the policy holds a lease) or fluentd (instead of the gRPC log)
            "access_log": s.access_log,
            # the policy's enforce: envoy limiters in Envoy's quota filter (envoy-config --rlqs)
            "rlqs": s.rlqs}
        if s.protocol == "ratelimit":
            return self._ratelimit_config(extauthz_port)
        if s.accesslog_flush_ms is not None:
            options["access_log_flush_ms"] = s.accesslog_flush_ms
        if s.access_log == "fluentd":
            options["access_log_to"] = ("127.0.0.1", self.fluentd_port)
        config: dict[str, Any] = yaml.safe_load(local_render(
            load_policy([policy_file(s)]), protocol=s.protocol, grpc_port=extauthz_port,
            http_port=self.http_port or extauthz_port, upstream_port=free_port(), **options))
        return config

    def _ratelimit_config(self, extauthz_port: int) -> dict[str, Any]:
        """The ratelimit filter's bootstrap (``envoy-config --protocol ratelimit``). The filter
        skips a route without a route entry (a direct response), so the route goes to the
        upstream cluster and that is a second listener of the same Envoy answering ``200 ok``
        itself (the generator's ``direct_upstream``): Envoy's CPU per request counts both
        listeners (more than (r)'s one)."""
        return ratelimit_bootstrap(
            load_policy([policy_file(self.setup)]), upstream=("127.0.0.1", free_port()),
            authz=("127.0.0.1", extauthz_port), headers={"api_key": "x-api-key"}, listen_port=0, admin_port=0,
            direct_upstream=True)

    def access_log(self) -> bool:
        """Whether Envoy sends the gRPC access log: always, or (``auto``) when the policy holds
        a lease, as ``extauthz envoy-config --access-log auto`` decides (the generator says)."""
        manager = self._config(1)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        return any(log["name"] == GRPC_ACCESS_LOGGER for log in manager["typed_config"].get("access_log", []))

    def _wait_workers(self, timeout: float = 60.0) -> None:
        assert self.server is not None
        deadline = time.monotonic() + timeout
        while "workers serving" not in self.server.log():
            if self.server.proc is None or self.server.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + self.server.log()[-2000:])
            if time.monotonic() > deadline:
                raise RuntimeError("workers not serving:\n" + self.server.log()[-2000:])
            time.sleep(0.1)

    def balance_workers(self, warm: Callable[[], None], attempts: int = 12) -> list[int]:
        """SO_REUSEPORT spreads connections at random: restart Envoy until every server worker
        holds at least one of Envoy's connections. Returns the connections per worker."""
        assert self.server is not None and self.server.proc is not None
        pids = children(self.server.proc.pid)
        counts: list[int] = []
        for _ in range(attempts):
            warm()
            ports = range(self.server.port, self.server.port + (self.setup.workers if self.setup.worker_ports else 1))
            by_pid = {pid: sum(established_by_pid(port, pids).get(pid, 0) for port in ports) for pid in pids}
            counts = [by_pid.get(p, 0) for p in pids]
            if counts and min(counts) > 0:
                return counts
            assert self.envoy is not None
            self.envoy.stop()
            self._start_envoy(self.server.port)
        return counts

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        if self.server is not None:
            self.server.stop()

    # -- observation
    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def server_pids(self) -> list[int]:
        if self.server is None or self.server.proc is None:
            return []
        pid = self.server.proc.pid
        return [pid, *children(pid)]

    def snapshot(self) -> dict[str, Any]:
        assert self.envoy is not None
        snap: dict[str, Any] = {
            "stats": self.envoy.stats(r"ext_authz\.|ratelimit\.|local_ratelimit\.|downstream_rq_2xx"),
            "envoy_cpu": cpu_seconds(self.envoy.pid),
            "server_cpu": {pid: cpu_seconds(pid) for pid in self.server_pids()},
            "redis_cpu": cpu_seconds(self.redis.pid) if self.redis is not None and self.setup.redis else 0.0,
            "fail_open": self.fail_open(),
            "redis_commands": self.redis_commands(),
            "store": self.store_counters(),
            "quota": self.quota() if self.setup.rlqs else {},
        }
        return snap

    def quota(self) -> dict[str, int]:
        """The quota stream's counters from admin ``/status`` ``quota`` (docs/rlqs.md), summed
        over the server's processes: reports read, bucket entries held by open streams (each
        report carries every bucket of its stream), over-admission, the store ledger's failed
        calls, what Envoy reported allowed and denied (since each bucket's subscription), and the
        open and closed streams (a closed one: Envoy's stream ended, e.g. reconnected)."""
        total = {"reports": 0, "streams": 0, "closed": 0, "bound_refused": 0, "buckets": 0, "overadmission": 0,
                 "ledger_failures": 0, "allowed": 0, "denied": 0}
        for i in range(self.setup.workers):
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{self.admin_base + i}/status", timeout=5) as resp:
                quota = json.load(resp).get("quota") or {}
            total["reports"] += int(quota.get("reports", 0))
            total["overadmission"] += int(quota.get("overadmission", 0))
            total["ledger_failures"] += int((quota.get("ledger") or {}).get("failures", 0))
            # streams or reports a bound refused (streams, buckets, outbox: docs/rlqs.md)
            total["bound_refused"] += sum(int(n) for n in (quota.get("refused") or {}).values())
            for stream in quota.get("streams") or ():
                if stream.get("closed"):  # its holds wait for their TTL
                    total["closed"] += 1
                    continue
                buckets = stream.get("buckets") or ()
                total["streams"] += 1
                total["buckets"] += len(buckets)
                total["allowed"] += sum(int(b.get("allowed", 0)) for b in buckets)
                total["denied"] += sum(int(b.get("denied", 0)) for b in buckets)
        return total

    def redis_commands(self) -> dict[str, int]:
        """Redis ``INFO commandstats``: calls by command (lowercase, ``cmdstat_`` dropped)."""
        if self.redis is None or not self.setup.redis:
            return {}
        import redis

        with redis.Redis(port=self.redis.port, socket_timeout=5) as client:
            stats = client.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}

    def store_counters(self) -> dict[str, float]:
        """The server's store counters (``/metrics``), summed over its processes."""
        if self.server is None or not self.metrics_base:
            return {}
        from prometheus_client.parser import text_string_to_metric_families

        total: dict[str, float] = {}
        for i in range(self.setup.workers):
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{self.metrics_base + i}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    name = sample.name
                    if name == DEADLINE_MISSED:
                        name = f"{name}:{sample.labels.get('where', '')}"
                    elif name not in STORE_COUNTERS:
                        continue
                    total[name] = total.get(name, 0.0) + sample.value
        return total

    def fail_open(self) -> dict[str, int]:
        """Fail-open counts by reason, summed over the server processes (admin /status), and
        under ``OVERLOAD_CHECKS`` the checks decided while starved (``overload.checks``)."""
        if self.server is None:
            return {}
        total: dict[str, int] = {}
        for i in range(self.setup.workers):
            try:
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                        f"http://127.0.0.1:{self.admin_base + i}/status", timeout=2) as resp:
                    status = json.load(resp)
            except (OSError, ValueError):
                total["admin_unreachable"] = total.get("admin_unreachable", 0) + 1
                continue
            for reason, n in (status.get("fail_open") or {}).items():
                total[reason] = total.get(reason, 0) + int(n)
            starved = sum(int(n) for n in ((status.get("overload") or {}).get("checks") or {}).values())
            total[OVERLOAD_CHECKS] = total.get(OVERLOAD_CHECKS, 0) + starved
        return total


def stat_value(stats: dict[str, int], suffix: str) -> int | None:
    for name, value in stats.items():
        if name.endswith(suffix) and not name.startswith("listener.admin"):
            return value
    return None


def fill_counters(phase: Phase, before: dict[str, Any], after: dict[str, Any], setup: Setup) -> None:
    def delta(suffix: str) -> int | None:
        a, b = stat_value(after["stats"], suffix), stat_value(before["stats"], suffix)
        return None if a is None or b is None else a - b

    n = max(1, phase.requests)
    flood = setup.load == "flood"
    if setup.ext_authz:
        # the ratelimit filter's stats in the ext_authz fields (ok, failure_mode_allowed,
        # error, over_limit for denied): the server answered every request, or not
        rl = setup.protocol == "ratelimit"
        prefix = "ratelimit." if rl else "ext_authz."
        phase.ext_authz_ok = delta(prefix + "ok")
        phase.ext_authz_failure_mode_allowed = delta(prefix + "failure_mode_allowed")
        phase.ext_authz_error = delta(prefix + "error")
        phase.ext_authz_denied = delta(prefix + ("over_limit" if rl else "denied"))
        cpu_before, cpu_after = before["server_cpu"], after["server_cpu"]
        used = {pid: cpu_after[pid] - cpu_before.get(pid, 0.0) for pid in cpu_after}
        phase.server_cpu_us = sum(used.values()) / n * 1e6
        if setup.workers > 1:
            workers = [pid for pid in cpu_after if pid != min(cpu_after)]
            total = sum(used[p] for p in workers) or 1.0
            phase.worker_cpu_share = [round(used[p] / total, 3) for p in workers]
        phase.overload_checks = after["fail_open"].get(OVERLOAD_CHECKS, 0) - before["fail_open"].get(OVERLOAD_CHECKS, 0)
        phase.fail_open = {k: after["fail_open"].get(k, 0) - before["fail_open"].get(k, 0)
                           for k in after["fail_open"] if k != OVERLOAD_CHECKS
                           and after["fail_open"].get(k, 0) != before["fail_open"].get(k, 0)}
        if phase.overload_checks:
            phase.problems.append(f"the server was starved: {phase.overload_checks} checks decided as "
                                  "overload (its shedders refused the non-critical ones): figures not comparable")
        if phase.fail_open:
            phase.problems.append(f"the server failed open {sum(phase.fail_open.values())} times "
                                  "(store deadline or breaker): figures not comparable")
        # Under a flood (Setup.load) the flooding key is refused: Envoy counts it as denied
        # and the client sees 429s; every other request must still be a full, allowed Check.
        answered = (phase.ext_authz_ok or 0) + ((phase.ext_authz_denied or 0) if flood else 0)
        if not phase.ext_authz_ok:
            phase.problems.append(f"the server was not consulted ({prefix}ok did not move)")
        elif answered < 0.99 * phase.requests:
            phase.problems.append(f"ext_authz.ok {phase.ext_authz_ok} < requests {phase.requests}")
        for name, value in (("failure_mode_allowed", phase.ext_authz_failure_mode_allowed),
                            ("error", phase.ext_authz_error),
                            ("denied", None if flood else max(0, (phase.ext_authz_denied or 0)
                                                                   - phase.overload_checks))):
            if value:
                phase.problems.append(f"{prefix}{name} = {value}")
        if flood and not phase.ext_authz_denied:
            phase.problems.append("the flooding key was never refused (ext_authz.denied did not move)")
    if setup.local_ratelimit:
        phase.local_ratelimit_ok = delta("http_local_rate_limit.ok")
        if not phase.local_ratelimit_ok:
            phase.problems.append("local_ratelimit did not count the requests")
    if setup.rlqs:
        fill_quota(phase, before, after, setup)
    phase.envoy_cpu_us = (after["envoy_cpu"] - before["envoy_cpu"]) / n * 1e6
    if setup.redis:
        phase.redis_cpu_us = (after["redis_cpu"] - before["redis_cpu"]) / n * 1e6
        # the snapshots' own INFO calls are not the server's
        cmds = {c: after["redis_commands"][c] - before["redis_commands"].get(c, 0)
                for c in after["redis_commands"] if c != "info"}
        phase.redis_commands = {c: k / n for c, k in sorted(cmds.items(), key=lambda kv: -kv[1]) if k}
        store_after, store_before = after["store"], before["store"]
        if STORE_COUNTERS[0] in store_after and STORE_COUNTERS[0] in store_before:
            phase.store_round_trips = (store_after[STORE_COUNTERS[0]] - store_before[STORE_COUNTERS[0]]) / n
            phase.store_script_calls = (store_after[STORE_COUNTERS[1]] - store_before[STORE_COUNTERS[1]]) / n
        phase.deadline_missed = {name.split(":", 1)[1]: int(v - store_before.get(name, 0.0))
                                 for name, v in store_after.items() if name.startswith(f"{DEADLINE_MISSED}:")}
    # the flooding key's refusals are expected (429s; Envoy's and wrk's counts may differ by
    # the requests in flight at either end)
    unexpected = phase.non_2xx - ((phase.ext_authz_denied or 0) if flood else 0) - (phase.refused or 0)
    if flood and abs(unexpected) <= 0.01 * n:
        unexpected = 0
    if unexpected or phase.errors:
        phase.problems.append(f"{unexpected} unexpected non-2xx responses, {phase.errors} socket errors")


def fill_quota(phase: Phase, before: dict[str, Any], after: dict[str, Any], setup: Setup) -> None:
    """The quota rows (``Setup.rlqs``, issue 33): Envoy decides every request, the server reads
    usage reports. Its CPU per request and per report entry, the reports and what Envoy said it
    allowed and denied, and Envoy's refusals (its 429s, the load tool's non-2xx): the policy
    never refuses the benchmark traffic once a bucket holds its assignment, so a refusal in the
    measured window means a bucket without one (the start not excluded, or shares held back)."""
    n = max(1, phase.requests)
    q0, q1 = before["quota"], after["quota"]
    if not setup.ext_authz:
        used = sum(after["server_cpu"][pid] - before["server_cpu"].get(pid, 0.0) for pid in after["server_cpu"])
        phase.server_cpu_us = used / n * 1e6
    phase.quota_reports = q1["reports"] - q0["reports"]
    # every report carries each bucket its Envoy holds (idle ones 0/0): entries = reports x buckets
    phase.quota_buckets = q1["buckets"]
    per_stream = q1["buckets"] / q1["streams"] if q1["streams"] else 0.0
    phase.quota_entries = round(phase.quota_reports * per_stream)
    if phase.quota_entries and phase.server_cpu_us is not None:
        phase.server_cpu_us_per_entry = phase.server_cpu_us * n / phase.quota_entries
    phase.quota_allowed = q1["allowed"] - q0["allowed"]
    phase.quota_denied = q1["denied"] - q0["denied"]
    phase.quota_overadmission = q1["overadmission"] - q0["overadmission"]
    phase.quota_ledger_failures = q1["ledger_failures"] - q0["ledger_failures"]
    phase.refused = phase.non_2xx
    # a stream closed in the warm-up too: its holds stay until their TTL, so the new stream's
    # buckets wait (refused) and the measured window is not the steady state
    if q1["closed"] or q1["bound_refused"]:
        phase.problems.append(f"{q1['closed']} quota stream(s) closed, {q1['bound_refused']} refused by a bound "
                              "(e.g. the outbox: Envoy reconnected, its new stream waits for the old one's "
                              "holds): figures not comparable")
    if phase.quota_reports == 0 and phase.seconds > REPORT_INTERVAL:
        phase.problems.append("the quota stream read no report (the server was not consulted)")
    if phase.refused:
        phase.problems.append(f"Envoy's quota filter refused {phase.refused} of {phase.requests} requests in the "
                              "measured run (a bucket without an assignment): figures not comparable")
    if phase.quota_overadmission:
        phase.problems.append(f"quota over-admission {phase.quota_overadmission} (must stay 0)")
    if phase.quota_ledger_failures:
        phase.problems.append(f"the store ledger failed {phase.quota_ledger_failures} times: figures not comparable")
