"""The benchmark harness: real Envoy, the real server process, a real Redis, real load tools.

One command (``bench/run.sh`` or ``python -m bench.harness``) starts, for each configuration,
Envoy in front of a trivial upstream, the extauthz server as a process, and drives it with
``wrk`` (saturated throughput) and ``h2load`` (latency at a fixed 1,000 req/s):

  a   Envoy alone (ext_authz filter removed)
  b   Envoy + the no-op server: the same server, every limiter ``mode: off`` (the ceiling)
  c   Envoy + the server, all four limiters, embedded store
  d   Envoy + the server, all four limiters, Redis store
  e   Envoy's own local_ratelimit filter (the in-proxy reference)
  d1  (d) with Envoy --concurrency 2, one server process
  d2  (d) with Envoy --concurrency 2, ``extauthz serve --workers 2`` (one SO_REUSEPORT port)
  d2p (d2) with ``--worker-ports``: two ports listed as two endpoints of Envoy's cluster
  b-aio, d-aio  (b), (d) on the plain asyncio event loop instead of uvloop
  b-all, r-all  (b), (r) without ext_authz ``allowed_headers``: every request header sent
  b-buf0, d-buf0  (b), (d) with the access log sent entry by entry (the shipped configs
                batch it every 5 ms / 4 KiB; b-buf, d-buf = b, d now: ``--only`` and
                ``bench.accesslog_flush`` only)
  h   (b) on Envoy's HTTP authorization protocol (envoy-http.yaml, ``serve --http-listen``)
  hc  (c) over HTTP: all four limiters, embedded store
  hd  (d) over HTTP: all four limiters, Redis store
  d-buf20  (d) with the access log buffered 20 ms
  r   Envoy + the server, one request_rate limiter, Redis store (issue 16's shape, beside
      the Go envoyproxy/ratelimit figures quoted in docs/benchmarks.md); rh: the same over HTTP,
      without the access log its policy does not need (``extauthz envoy-config --access-log auto``)
  rhb (rh) with ``consistency: batched`` (bench/policies/rate-only-batched.yaml)
  rl  the peer table's shape: Envoy's ratelimit filter (``envoy-config --protocol ratelimit``),
      one descriptor per API key, the (r) limiter behind it on Redis (rate-descriptor.yaml)
  q   issue 33: (r)'s limiter enforced in Envoy (``enforce: envoy``, ``envoy-config --rlqs``):
      Envoy's rate limit quota filter holds a token bucket per API key (1,000 buckets under
      wrk, one under h2load), no ext_authz; the server reads the usage reports (every 5 s, each
      carrying every bucket) and divides the limit, its ledger on Redis; q-mem: the embedded
      store (no store ledger). Their warm-up lasts at least ``RLQS_WARMUP`` s: a bucket's first
      request is refused (``no_assignment_behavior``: DENY_ALL) and its first usage report
      (``time_elapsed`` 0) only subscribes it, so the measured window starts after every bucket
      has its assignment and has sent one report with demand (on Redis, after the new store's
      two report intervals in which no share grows)
  hdb (hd) with request_rate and fleet_usage batched (bench/policies/all-on-batched.yaml)
  hdf (hd) with the releases through Envoy's fluentd access logger (``serve --fluentd-listen``,
      ``extauthz envoy-config --access-log fluentd``) instead of the gRPC access log
  f   (d) under a flood, 10 requests/s per key: one key sends half of all requests (refused),
      the other half rotates over 1,000 well-behaved keys; fc: the same load without the
      flooding key (1,000 other well-behaved keys in its place). Their latency run is two
      paced wrk processes at half the rate each (HTTP/1.1, 16 connections each); the p99 is
      the well-behaved keys' alone (h2load cannot vary the key per request)

A named subset: ``--only r,d,b`` (same as ``--configs``), ``--rounds N``.

(The table of configurations is ``bench/configs.py``.) This module runs the rounds, the Redis
outage runs and the CLI; ``bench/stack.py`` starts one configuration's stack and reads its
counters, ``bench/load.py`` runs wrk and h2load, ``bench/stats.py`` holds the per-run record
and the medians, ratios and targets, ``bench/report.py`` writes docs/benchmarks.md and the plot.

Envoy answers ``200 ok`` itself (``direct_response_upstream``): the upstream is never the
bottleneck. Tracing is off. The policies in ``bench/policies`` never refuse the benchmark
traffic (1,000 rotating API keys under wrk; one key under h2load), so every request is a full
Check. Each configuration's log lines and summary show its store script calls per request
and its ``timeout`` fail-opens (store deadline misses). Every figure is checked: Envoy's
``ext_authz.ok`` must count every request, ``failure_mode_allowed`` and ``error`` must stay 0
(fail-open would hide a dead server), and the server's fail-open counters (admin ``/status``)
are reported.

The machine is noisy: rounds are interleaved (every configuration once per round) and the
tables show medians; ratios are taken inside a round, then the median of the ratios.
Results go to ``docs/benchmarks.md`` (between the generated-section markers), a PNG plot and
a JSON file. ``--smoke`` is a short CI check: a few seconds per configuration, one round,
no plot or docs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from extauthz.devtools.stack import free_port
from extauthz.engine.quota_service import REPORT_INTERVAL

from .configs import DEFAULT_SETUPS, SETUPS, SMOKE_SETUPS, Options, Setup, policy_file
from .load import (
    CALM_PREFIX,
    FLOOD_KEY,
    HOT_KEY,
    h2load_cmd,
    read_h2load_log,
    require_tools,
    run_wrk,
    run_wrk_pair,
    wrk_script,
)
from .procs import RedisServer, find_redis_server
from .report import (
    DOCS,
    PLOT,
    ROOT,
    environment,
    fmt,
    markdown,
    phase_redis_calls,
    plot,
    row_store_figures,
    write_docs,
)
from .stack import Running, fill_counters, stat_value
from .stats import Phase, latency_summary, summarize, targets

#: wrk connections of each of the two paced loads of the flood configurations
FLOOD_CONNECTIONS = 16
#: the loads whose paced run is two wrk processes (the others: h2load, one key)
PAIRED = ("flood", "calm")
#: the quota rows' shortest warm-up (Setup.rlqs): a store ledger on a store with no marker (the
#: harness flushes Redis before each run) grows no share for two report intervals (docs/rlqs.md,
#: "A store that loses its data"), then one report interval and a second, so every bucket
#: holds its assignment and has reported its demand once before the measured window
RLQS_WARMUP = 3 * REPORT_INTERVAL + 1.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Harness:
    """One run: every configuration once per round, then the outage runs and the comparison."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.workdir = Path(tempfile.mkdtemp(prefix="extauthz-bench-"))
        self.script = wrk_script(self.workdir)
        self.flood_script = wrk_script(self.workdir, name="flood.lua", flood_key=FLOOD_KEY)
        self.hot_script = wrk_script(self.workdir, 0, name="hot.lua", flood_key=HOT_KEY)
        self.redis: RedisServer | None = None
        self.phases: list[Phase] = []
        self.outages: list[dict[str, Any]] = []
        self.limits: dict[str, Any] | None = None

    def setups(self) -> list[Setup]:
        return [SETUPS[k] for k in self.opts.setups]

    def run(self) -> None:
        require_tools()
        needs_redis = any(s.redis for s in self.setups()) or self.opts.limits_compare
        if needs_redis and find_redis_server() is None:
            raise SystemExit("configurations on Redis need redis-server: run scripts/install-system-deps.sh")
        try:
            if needs_redis:
                (self.workdir / "redis").mkdir()
                self.redis = RedisServer(free_port(), self.workdir / "redis").start()
                if self.opts.redis_nice:  # issue 29: is a late Redis this shared machine's scheduler?
                    os.setpriority(os.PRIO_PROCESS, self.redis.pid, self.opts.redis_nice)
            for r in range(self.opts.rounds):
                for kind in ("saturated", "latency"):
                    for setup in self.setups():
                        self.phases.append(self.measure(setup, kind, r))
            if self.opts.outage and not self.opts.smoke:
                for mode in self.opts.outage:
                    self.outages.append(self.outage(mode))
            if self.opts.limits_compare and self.redis is not None and not self.opts.smoke:
                from .limits_compare import compare

                log("limits comparison (Redis store vs the limits library)")
                self.redis_flush()
                self.limits = compare(self.redis.url, seconds=min(self.opts.duration, 5.0))
        finally:
            if self.redis is not None:
                self.redis.stop()

    def redis_flush(self) -> None:
        if self.redis is None:
            return
        import redis

        with redis.Redis(port=self.redis.port) as client:
            client.flushall()

    def measure(self, setup: Setup, kind: str, r: int) -> Phase:
        opts = self.opts
        if setup.redis:
            self.redis_flush()
        phase = Phase(setup.key, kind, r)
        running = Running(setup, self.redis if setup.redis else None, opts, self.workdir).start()
        warmup = max(opts.warmup, RLQS_WARMUP) if setup.rlqs else opts.warmup
        try:
            def warm() -> None:
                if kind == "saturated":
                    self._wrk(running.url, warmup, setup)
                elif setup.load in PAIRED:
                    self._paced_pair(running.url, warmup, setup)
                else:
                    self._h2load(running.url, warmup, "warm")

            if setup.workers > 1:
                phase.worker_connections = running.balance_workers(warm)
                if not phase.worker_connections or min(phase.worker_connections) == 0:
                    phase.problems.append(f"server workers hold {phase.worker_connections} connections")
            else:
                warm()
            before = running.snapshot()
            if kind == "saturated":
                res = self._wrk(running.url, opts.duration, setup)
                phase.requests, phase.seconds = int(res["requests"]), res["seconds"]
                phase.rps, phase.non_2xx, phase.errors = res["rps"], int(res["non_2xx"]), int(res["errors"])
                if setup.load == "flood":
                    phase.flood_rps = phase.rps / 2  # every other request
            elif setup.load in PAIRED:
                calm, second = self._paced_pair(running.url, opts.duration, setup)
                phase.requests = int(calm["requests"] + second["requests"])
                phase.seconds = max(calm["seconds"], second["seconds"])
                phase.rps = calm["rps"] + second["rps"]
                phase.non_2xx = int(calm["non_2xx"] + second["non_2xx"])
                phase.errors = int(calm["errors"] + second["errors"])
                phase.p50_ms, phase.p99_ms, phase.p999_ms = calm["p50_ms"], calm["p99_ms"], calm["p999_ms"]
                phase.flood_rps = second["rps"]
            else:
                rows = self._h2load(running.url, opts.duration, f"{setup.key}-{r}")
                phase.requests = len(rows)
                phase.seconds = opts.duration
                phase.rps = len(rows) / opts.duration
                phase.non_2xx = sum(1 for _, status, _ in rows if status != 200)
                for k, v in latency_summary(rows).items():
                    setattr(phase, k, v)
            after = running.snapshot()
            if setup.load == "flood" and phase.flood_rps is not None:
                phase.flood_factor = phase.flood_rps / flood_key_rate(setup)
            fill_counters(phase, before, after, setup)
        finally:
            running.stop()
        figure = (f"{phase.rps:,.0f} req/s" if kind == "saturated" else
                  f"p50 {phase.p50_ms:.2f} p99 {phase.p99_ms:.2f} p99.9 {phase.p999_ms:.2f} ms "
                  f"at {phase.rps:,.0f}/s")
        cpu = f", server {phase.server_cpu_us:.0f} us/req" if phase.server_cpu_us is not None else ""
        if phase.envoy_cpu_us is not None and setup.rlqs:
            cpu += (f", Envoy {phase.envoy_cpu_us:.0f} us/req, refused {phase.refused}, quota reports "
                    f"{phase.quota_reports} ({phase.quota_entries} entries, {phase.quota_buckets} buckets, "
                    f"server {fmt(phase.server_cpu_us_per_entry)} us/entry), Envoy reported allowed "
                    f"{phase.quota_allowed} denied {phase.quota_denied}")
        extra = f", workers {phase.worker_connections} conns {phase.worker_cpu_share} cpu" \
            if phase.worker_connections else ""
        bad = f"  PROBLEMS: {'; '.join(phase.problems)}" if phase.problems else ""
        fo = f", fail-open {phase.fail_open}" if phase.fail_open else ""
        if any(phase.deadline_missed.values()):
            fo += f", deadlines passed {phase.deadline_missed}"
        if phase.flood_factor is not None:
            fo += f", flooding key at {phase.flood_factor:.0f}x its rate"
        log(f"round {r + 1} {kind:9} {setup.key:5} {setup.label:36} {figure}{cpu}{extra}{fo}"
            f"{phase_redis_calls(phase)}{bad}")
        return phase

    def _wrk(self, url: str, seconds: float, setup: Setup | None = None) -> dict[str, float]:
        load = setup.load if setup is not None else "users"
        script = self.flood_script if load == "flood" else self.hot_script if load == "hot" else self.script
        return run_wrk(url, seconds, script, threads=self.opts.threads, connections=self.opts.connections)

    def _paced_pair(self, url: str, seconds: float,
                    setup: Setup) -> tuple[dict[str, float], dict[str, float]]:
        """The flood configurations' paced run: the well-behaved keys at half the rate, and
        at the other half the flooding key ("flood") or 1,000 other well-behaved keys ("calm")."""
        half = self.opts.rate / 2
        calm = wrk_script(self.workdir, name="paced-users.lua", rate=half)
        second = (wrk_script(self.workdir, 0, name="paced-flood.lua", flood_key=FLOOD_KEY, rate=half)
                  if setup.load == "flood" else
                  wrk_script(self.workdir, name="paced-calm.lua", prefix=CALM_PREFIX, rate=half))
        return run_wrk_pair(url, seconds, (calm, second), connections=FLOOD_CONNECTIONS)

    def targets(self, summary: dict[str, Any]) -> list[dict[str, Any]]:
        return targets(summary, limits=self.limits, outages=self.outages, deadline_ms=self.opts.deadline_ms)

    def markdown(self, summary: dict[str, Any], env: dict[str, str], command: str) -> str:
        return markdown(self.opts, summary, env, command, outages=self.outages, limits=self.limits)

    def _h2load(self, url: str, seconds: float, tag: str, *, rate: int | None = -1,
                h1: bool = False, clients: int | None = None) -> list[tuple[int, int, int]]:
        log_file = self.workdir / f"h2load-{tag}.log"
        log_file.unlink(missing_ok=True)
        rate = self.opts.rate if rate == -1 else rate
        cmd = h2load_cmd(url, seconds, log_file, rate=rate,
                         clients=clients or (self.opts.rate_clients if rate else self.opts.connections),
                         h1=h1)
        subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60)
        return read_h2load_log(log_file)

    # -- Redis outage: (d) keeps serving (fail open) while Redis is down
    def outage(self, mode: str) -> dict[str, Any]:
        """One continuous load run against (d); Redis is killed (or paused) halfway through."""
        setup = SETUPS["d"]
        opts = self.opts
        result: dict[str, Any] = {"mode": mode, "seconds": opts.outage_duration}
        for kind in ("saturated", "latency"):
            with RedisServer(free_port(), Path(tempfile.mkdtemp(dir=self.workdir))) as redis:
                running = Running(setup, redis, opts, self.workdir).start()
                try:
                    rate = None if kind == "saturated" else opts.rate
                    clients = opts.connections if kind == "saturated" else opts.rate_clients
                    self._h2load(running.url, opts.warmup, "outage-warm", rate=rate, h1=kind == "saturated",
                                 clients=clients)
                    before = running.fail_open()
                    total = 2 * opts.outage_duration
                    log_file = self.workdir / f"h2load-outage-{mode}-{kind}.log"
                    log_file.unlink(missing_ok=True)
                    cmd = h2load_cmd(running.url, total, log_file, rate=rate, clients=clients,
                                     h1=kind == "saturated")
                    load = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    started = time.time()
                    time.sleep(opts.outage_duration)
                    cut = time.time()
                    if mode == "kill":
                        redis.kill()
                    else:
                        redis.pause()
                    load.wait(timeout=total + 60)
                    if mode == "pause":
                        redis.resume()
                    after = running.fail_open()
                    stats = running.envoy.stats("ext_authz\\.") if running.envoy else {}
                finally:
                    running.stop()
            rows = read_h2load_log(log_file)
            cut_us, start_us = int(cut * 1e6), int(started * 1e6)
            up = [row for row in rows if start_us + 1e6 <= row[0] < cut_us]
            down = [row for row in rows if cut_us <= row[0] < start_us + (total - 0.5) * 1e6]
            steady = [row for row in down if row[0] >= cut_us + 1e6]
            up_s, down_s = (cut_us - start_us) / 1e6 - 1.0, total - 0.5 - (cut_us - start_us) / 1e6
            fig: dict[str, Any] = {
                "up_rps": len(up) / up_s, "down_rps": len(down) / down_s,
                "up": latency_summary(up), "down": latency_summary(down),
                "down_steady": latency_summary(steady),
                "non_2xx": sum(1 for row in rows if row[1] != 200),
                "fail_open": {k: after.get(k, 0) - before.get(k, 0) for k in after},
                "failure_mode_allowed": stat_value(stats, "ext_authz.failure_mode_allowed"),
            }
            result[kind] = fig
            log(f"outage ({mode}) {kind}: up {fig['up_rps']:,.0f}/s p99 {fig['up']['p99_ms']:.2f} ms; "
                f"down {fig['down_rps']:,.0f}/s p99 {fig['down']['p99_ms']:.2f} ms; fail-open {fig['fail_open']}")
        return result


def flood_key_rate(setup: Setup) -> float:
    """The flooding key's limit: the ``rate`` of the policy's request_rate limiter."""
    from extauthz.policy import load_policy

    policy = load_policy([policy_file(setup)])
    return min(float(lim.rate) for lim in policy.limiters if lim.type == "request_rate")


def parse_args(argv: Sequence[str] | None) -> tuple[Options, str]:
    p = argparse.ArgumentParser(prog="python -m bench.harness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", "--only", default=None,
                   help=f"comma-separated configurations (default {','.join(DEFAULT_SETUPS)}; "
                   f"smoke: {','.join(SMOKE_SETUPS)})")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    p.add_argument("--duration", type=float, default=None, help="seconds per measured run (default 10)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up per run (default 2)")
    p.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    p.add_argument("--threads", type=int, default=1, help="wrk threads (default 1)")
    p.add_argument("--rate", type=int, default=1000, help="paced rate, req/s (default 1000)")
    p.add_argument("--outage", default="kill,pause",
                   help="Redis outage scenarios for (d): kill, pause, or none (default kill,pause)")
    p.add_argument("--outage-duration", type=float, default=10.0,
                   help="seconds before and after Redis stops in the outage runs (default 10)")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="the server's --store-deadline-ms (default 5, as shipped; a brief check on a busy "
                   "machine may raise it so that the breaker does not hide the store calls)")
    p.add_argument("--redis-nice", type=int, default=0,
                   help="the benchmark Redis's nice value (e.g. -10: its own share of the shared "
                   "cores, as Redis on its own cores in production; default 0, as the other processes)")
    p.add_argument("--no-limits", action="store_true", help="skip the limits library comparison")
    p.add_argument("--smoke", action="store_true",
                   help="CI check: 2 s runs, 1 round, (a)(b)(c), no outage, no plot, no docs")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md and the plot")
    p.add_argument("--report-from", type=Path, default=None,
                   help="rewrite docs/benchmarks.md and the plot from an earlier run's --json file")
    a = p.parse_args(argv)
    opts = Options(connections=a.connections, threads=a.threads, rate=a.rate, json_path=a.json,
                   outage_duration=a.outage_duration, redis_nice=a.redis_nice)
    if a.smoke:
        opts.setups, opts.rounds, opts.duration, opts.warmup = SMOKE_SETUPS, 1, 2.0, 0.5
        opts.outage, opts.limits_compare, opts.docs, opts.plot = (), False, False, False
    if a.configs:
        unknown = [k for k in a.configs.split(",") if k not in SETUPS]
        if unknown:
            p.error(f"unknown configurations {unknown}; known: {', '.join(SETUPS)}")
        opts.setups = tuple(a.configs.split(","))
    if a.rounds is not None:
        opts.rounds = a.rounds
    if a.duration is not None:
        opts.duration = a.duration
    if a.warmup is not None:
        opts.warmup = a.warmup
    if a.deadline_ms is not None:
        opts.deadline_ms = a.deadline_ms
    if a.outage != "kill,pause" and not a.smoke:
        opts.outage = () if a.outage == "none" else tuple(a.outage.split(","))
    if a.no_limits:
        opts.limits_compare = False
    if a.no_docs:
        opts.docs = opts.plot = False
    opts.report_from = a.report_from
    command = "python -m bench.harness" + ("" if argv is None else " " + " ".join(argv))
    if argv is None and len(sys.argv) > 1:
        command = "python -m bench.harness " + " ".join(sys.argv[1:])
    return opts, command


def load_run(path: Path, opts: Options) -> tuple[Harness, dict[str, Any], str]:
    """A Harness holding an earlier run's figures (``--json``), its environment and command."""
    data = json.loads(path.read_text())
    saved = data["options"]
    for name in ("setups", "rounds", "duration", "warmup", "connections", "threads", "rate",
                 "rate_clients", "deadline_ms", "outage", "outage_duration"):
        if name in saved:
            value = saved[name]
            setattr(opts, name, tuple(value) if isinstance(value, list) else value)
    h = Harness(opts)
    h.phases = [Phase(**p) for p in data["phases"]]
    h.outages = data.get("outages") or []
    h.limits = data.get("limits")
    env = data.get("environment") or environment()
    if env.get("envoy", "n/a") == "n/a":
        env["envoy"] = environment()["envoy"]
    return h, env, data.get("command") or "python -m bench.harness"


def main(argv: Sequence[str] | None = None) -> int:
    opts, command = parse_args(argv)
    if opts.report_from is not None:
        h, env, command = load_run(opts.report_from, opts)
        summary = summarize(h.setups(), h.phases)
        write_docs(h.markdown(summary, env, command))
        plot(summary)
        shutil.rmtree(h.workdir, ignore_errors=True)
        log(f"wrote {DOCS.relative_to(ROOT)} and {PLOT.relative_to(ROOT)} from {opts.report_from}")
        return 0
    if opts.limits_compare and not opts.smoke and importlib.util.find_spec("limits") is None:
        # the comparison runs last: find out now, not after the whole run
        raise SystemExit("the limits comparison needs the `limits` library: pip install -e '.[bench]' "
                         "(bench/run.sh does), or pass --no-limits")
    h = Harness(opts)
    log(f"configurations {', '.join(opts.setups)}; {opts.rounds} round(s) of {opts.duration:g} s runs; "
        f"work dir {h.workdir}")
    try:
        h.run()
    finally:
        summary = summarize(h.setups(), h.phases) if h.phases else {"rows": [], "ratios": {}}
        result: dict[str, Any] = {
            "command": command,
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
            "environment": environment() if not opts.smoke else {},
            "phases": [asdict(p) for p in h.phases],
            "summary": summary,
            "outages": h.outages,
            "limits": h.limits,
            "targets": h.targets(summary),
        }
        if opts.json_path is not None:
            opts.json_path.write_text(json.dumps(result, indent=2, default=str))
    for row in summary["rows"]:
        log(f"{row['key']:5} {row['label']:36} {fmt(row['rps']):>8} req/s  p50 {fmt(row['p50_ms'], '{:.2f}')} "
            f"p99 {fmt(row['p99_ms'], '{:.2f}')} p99.9 {fmt(row['p999_ms'], '{:.2f}')} ms  "
            f"server {fmt(row['server_cpu_us'])} us/req{row_store_figures(row)}")
    for name, r in summary["ratios"].items():
        log(f"ratio {name}: {fmt(r['median'], '{:.3f}')} {r['rounds']}")
    for t in result["targets"]:
        log(f"target {t['target']}: {t['value']} (goal {'>=' if t['higher'] else '<='} {t['goal']}) "
            f"{'met' if t['met'] else 'MISSED'}")
    if opts.docs:
        env = result["environment"] or environment()
        write_docs(h.markdown(summary, env, command))
        log(f"wrote {DOCS.relative_to(ROOT)}")
    if opts.plot:
        plot(summary)
        log(f"wrote {PLOT.relative_to(ROOT)}")
    shutil.rmtree(h.workdir, ignore_errors=True)
    bad = [p for p in h.phases if any("not consulted" in x for x in p.problems)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
