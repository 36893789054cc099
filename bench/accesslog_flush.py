"""Access-log batching by measurement (issue 16, item 5).

Envoy's gRPC access log is the server's "request finished" signal: a concurrency slot (lease)
stays held until the request's entry reaches the server and the release reaches the store.
Envoy can send each entry at once (``buffer_size_bytes: 0``: "0 ms") or batch them for
``buffer_flush_interval`` (5 ms, as shipped, or 20 ms, with ``buffer_size_bytes`` to match:
``ACCESS_LOG_BYTES_PER_MS``). For each setting, on configuration (d) (all four limiters, Redis):

* throughput: ``wrk``, saturated (as the harness), with server and Envoy CPU per request;
* p50/p99 at the paced rate: ``h2load`` at 1,000 req/s (as the harness);
* slot held after the request ended: during the paced run, a probe sends requests of its own,
  one at a time at random moments (so that they fall anywhere in Envoy's flush period), each with
  an API key no other request uses, and times from the moment its response is read to the
  moment that key's concurrency leases read 0 in Redis (``Store.inflight`` on the user's lease
  key, polled back to back on one connection; the poll's own round trip is the resolution and is
  printed). A sample whose response carries no ``RateLimit`` header was not limited by the
  server (fail-open) and is not counted.

Rounds are interleaved (every setting once per round) and the table shows medians over rounds.
The machine these run on is shared: compare the settings inside one run.

    python -m bench.accesslog_flush [--flush 0,5,20] [--rounds 3] [--duration 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from extauthz.devtools.stack import free_port
from extauthz.envoy.config import ACCESS_LOG_BYTES_PER_MS
from extauthz.policy.classify import hash_identity
from extauthz.store.keys import Keys

from .configs import SETUPS, Options, Setup
from .harness import Harness, log
from .load import PATH, require_tools
from .procs import RedisServer, find_redis_server
from .stack import Running, fill_counters
from .stats import Phase, latency_summary, percentile

#: the flush interval (ms) -> the harness row that runs it (0: each entry at once; 5: as shipped).
ROWS = {0.0: "d-buf0", 5.0: "d-buf", 20.0: "d-buf20"}
#: the concurrency limiter of bench/policies/all-on.yaml and how it names users.
LIMITER = "user-concurrency"
IDENTITY_SOURCE = "header:x-api-key"


def setup_for(flush_ms: float) -> Setup:
    row = ROWS.get(flush_ms)
    if row is not None:
        return SETUPS[row]
    return dataclasses.replace(SETUPS["d-buf"], key=f"d-buf{flush_ms:g}",
                               label=f"(d), access log buffered {flush_ms:g} ms", accesslog_flush_ms=flush_ms)


class SlotProbe:
    """Samples, in a thread, how long a concurrency slot stays held after its request ended."""

    def __init__(self, url: str, redis_url: str, *, gap_ms: float = 25.0, timeout: float = 5.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.redis_url = redis_url
        self.gap_ms = gap_ms
        self.timeout = timeout
        self.held_ms: list[float] = []
        self.poll_ms: list[float] = []
        self.unlimited = 0   # answered without RateLimit headers: the server did not limit it
        self.timed_out = 0   # still held after ``timeout``
        #: samples whose lease the first poll still found: none at all would mean the probe reads
        #: the wrong key (its figures would be the poll time, not the hold)
        self.seen_held = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> SlotProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout + 5)
        if self._error is not None:
            raise self._error

    async def _run(self) -> None:
        from extauthz.store.redis import RedisStore

        store = RedisStore.from_url(self.redis_url, deadline=1.0)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        keys = Keys()
        try:
            while not self._stop.is_set():
                await asyncio.sleep(random.uniform(0, self.gap_ms) / 1000)
                await self._sample(store, conn, keys)
        except BaseException as exc:  # reported by __exit__
            self._error = exc
        finally:
            conn.close()
            await store.close()

    async def _sample(self, store: Any, conn: http.client.HTTPConnection, keys: Keys) -> None:
        api_key = f"slot-probe-{uuid.uuid4().hex}"
        lease_key = keys.user_leases(LIMITER, hash_identity(api_key, IDENTITY_SOURCE))
        conn.request("GET", PATH, headers={"x-api-key": api_key})
        response = conn.getresponse()
        response.read()
        ended = time.perf_counter()
        if response.status != 200 or response.getheader("ratelimit") is None:
            self.unlimited += 1
            return
        first = True
        while True:
            t0 = time.perf_counter()
            (held,) = await store.inflight([lease_key])
            now = time.perf_counter()
            self.poll_ms.append((now - t0) * 1000)
            if first and held:
                self.seen_held += 1
            first = False
            if held == 0:
                self.held_ms.append((now - ended) * 1000)
                return
            if now - ended > self.timeout:
                self.timed_out += 1
                return

    def summary(self) -> dict[str, Any]:
        held = self.held_ms
        return {
            "samples": len(held),
            "held_p50_ms": percentile(held, 50), "held_p90_ms": percentile(held, 90),
            "held_p99_ms": percentile(held, 99), "held_max_ms": max(held) if held else float("nan"),
            "held_mean_ms": statistics.fmean(held) if held else float("nan"),
            "poll_ms": statistics.median(self.poll_ms) if self.poll_ms else float("nan"),
            "unlimited": self.unlimited, "timed_out": self.timed_out, "seen_held": self.seen_held,
        }


def paced_with_probe(h: Harness, setup: Setup, r: int) -> tuple[Phase, dict[str, Any]]:
    """The harness's paced (latency) run of ``setup`` with a :class:`SlotProbe` beside it."""
    assert h.redis is not None
    h.redis_flush()
    phase = Phase(setup.key, "latency", r)
    running = Running(setup, h.redis, h.opts, h.workdir).start()
    try:
        h._h2load(running.url, h.opts.warmup, "warm")
        before = running.snapshot()
        with SlotProbe(running.url, h.redis.url) as probe:
            rows = h._h2load(running.url, h.opts.duration, f"{setup.key}-{r}")
        after = running.snapshot()
    finally:
        running.stop()
    phase.requests, phase.seconds = len(rows), h.opts.duration
    phase.rps = len(rows) / h.opts.duration
    phase.non_2xx = sum(1 for _, status, _ in rows if status != 200)
    for k, v in latency_summary(rows).items():
        setattr(phase, k, v)
    fill_counters(phase, before, after, setup)
    return phase, probe.summary()


def _median(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key) is not None and row[key] == row[key]]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = "{:,.1f}") -> str:
    return "n/a" if value is None else spec.format(value)


def table(results: Sequence[dict[str, Any]], flushes: Sequence[float]) -> str:
    lines = [
        "| buffer_flush_interval | buffer_size_bytes | req/s (wrk) | server us/req | Envoy us/req "
        "| p50 / p99 ms at the paced rate | slot held after the response: p50 / p90 / p99 / max ms "
        "| samples | poll ms |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for flush in flushes:
        rows = [x for x in results if x["flush_ms"] == flush]
        size = 0 if flush == 0 else round(flush * ACCESS_LOG_BYTES_PER_MS)
        lines.append(
            f"| {'0 (each entry at once)' if flush == 0 else f'{flush:g} ms'} | {size:,} "
            f"| {_fmt(_median(rows, 'rps'), '{:,.0f}')} | {_fmt(_median(rows, 'server_cpu_us'), '{:.0f}')} "
            f"| {_fmt(_median(rows, 'envoy_cpu_us'), '{:.0f}')} "
            f"| {_fmt(_median(rows, 'p50_ms'), '{:.2f}')} / {_fmt(_median(rows, 'p99_ms'), '{:.2f}')} "
            f"| {_fmt(_median(rows, 'held_p50_ms'))} / {_fmt(_median(rows, 'held_p90_ms'))} / "
            f"{_fmt(_median(rows, 'held_p99_ms'))} / {_fmt(_median(rows, 'held_max_ms'))} "
            f"| {sum(x['samples'] for x in rows)} | {_fmt(_median(rows, 'poll_ms'), '{:.2f}')} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.accesslog_flush", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flush", default="0,5,20", help="flush intervals in ms, 0 = each entry at once "
                   "(default 0,5,20)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measured run (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per run (default 2)")
    p.add_argument("--rate", type=int, default=1000, help="paced rate, req/s (default 1000)")
    p.add_argument("--deadline-ms", type=float, default=5.0,
                   help="the server's --store-deadline-ms (default 5, as the harness); on a busy "
                   "machine a longer one keeps checks from failing open (no lease: no sample)")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    a = p.parse_args(argv)
    flushes = [float(x) for x in a.flush.split(",")]
    if any(f < 0 for f in flushes):
        p.error("--flush: intervals must not be negative")
    require_tools()
    if find_redis_server() is None:
        raise SystemExit("needs redis-server: run scripts/install-system-deps.sh")
    opts = Options(rounds=a.rounds, duration=a.duration, warmup=a.warmup, rate=a.rate,
                   deadline_ms=a.deadline_ms, outage=(), limits_compare=False, docs=False, plot=False)
    h = Harness(opts)
    results: list[dict[str, Any]] = []
    h.redis = RedisServer(free_port(), Path(tempfile.mkdtemp(dir=h.workdir))).start()
    try:
        for r in range(a.rounds):
            for flush in flushes:
                setup = setup_for(flush)
                saturated = h.measure(setup, "saturated", r)
                paced, probe = paced_with_probe(h, setup, r)
                if probe["samples"] and not probe["seen_held"]:
                    paced.problems.append("the probe never saw a lease held: does it read the lease key?")
                row = {"flush_ms": flush, "round": r, "rps": saturated.rps,
                       "server_cpu_us": saturated.server_cpu_us, "envoy_cpu_us": saturated.envoy_cpu_us,
                       "p50_ms": paced.p50_ms, "p99_ms": paced.p99_ms, "paced_rps": paced.rps,
                       "problems": saturated.problems + paced.problems, **probe}
                results.append(row)
                bad = f"  PROBLEMS: {'; '.join(row['problems'])}" if row["problems"] else ""
                log(f"round {r + 1} flush {flush:g} ms: {saturated.rps:,.0f} req/s; p99 {paced.p99_ms:.2f} ms; "
                    f"slot held p50 {probe['held_p50_ms']:.2f} p99 {probe['held_p99_ms']:.2f} ms "
                    f"({probe['samples']} samples, poll {probe['poll_ms']:.2f} ms, {probe['unlimited']} unlimited, "
                    f"{probe['timed_out']} timed out){bad}")
    finally:
        h.redis.stop()
    print(table(results, flushes))
    if a.json is not None:
        a.json.write_text(json.dumps({"argv": list(argv if argv is not None else sys.argv[1:]),
                                      "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
