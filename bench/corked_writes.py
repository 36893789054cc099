"""Corked writes (extauthz/core/cork.py): socket writes, instructions and CPU per check of the
HTTP authorization port, on the embedded store and on Redis.

``extauthz serve --http-listen`` with bench/policies/rate-only.yaml (one request_rate
limiter) is driven by ``h2load --h1`` (another process) with a fixed number of checks over
``--connections`` connections, ``--pipeline`` requests in flight on each (1: Envoy's shape,
it never pipelines; more: a pipelining client). Per check, over the measured checks only
(a warm-up first, not counted):

* socket writes: ``strace -f -c`` attached to the server (write, writev, sendto, sendmsg:
  the HTTP answers and, on Redis, the commands);
* user-space instructions: ``valgrind --tool=callgrind`` (counters zeroed after the warm-up);
* CPU microseconds: user + system time from ``/proc``.

To compare with the writes uncorked, run it on a checkout without the cork (the figures in
docs/design.md, "Corked writes", were taken that way).

    python -m bench.corked_writes [--checks 4000] [--connections 8] [--pipeline 1,8]
                                  [--stores memory,redis] [--no-callgrind] [--no-strace]
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from extauthz.devtools.stack import free_port

from .grpc_floor import CALLGRIND, cpu_per_check, instructions_per_check, stop
from .procs import RedisServer

POLICY = Path(__file__).with_name("policies") / "rate-only.yaml"
ROOT = Path(__file__).resolve().parent.parent
WRITES = "write,writev,sendto,sendmsg"


def load(port: int, checks: int, connections: int, pipeline: int) -> None:
    cmd = ["h2load", "--h1", "-n", str(checks), "-c", str(min(connections, checks)),
           "-m", str(pipeline), "-H", "x-api-key: sk_live_bench", f"http://127.0.0.1:{port}/v1/things"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
    m = re.search(r"status codes: (\d+) 2xx", out)
    if m is None or int(m.group(1)) != checks:
        raise RuntimeError(f"h2load: not every check answered 200:\n{out}")


def start(port: int, redis_url: str | None, prefix: list[str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [*prefix, sys.executable, "-m", "extauthz", "serve", "--policies", str(POLICY),
           "--listen", "off", "--http-listen", f"127.0.0.1:{port}", "--admin-listen", "off",
           "--log-level", "warning", "--store-deadline-ms", "5000"]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_serving(port: int, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            load(port, 1, 1, 1)
            return
        except (subprocess.CalledProcessError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def writes_per_check(pid: int, drive: Callable[[int], None], checks: int, out: Path) -> float:
    """Socket write system calls per check: strace attached while ``drive(checks)`` runs."""
    tracer = subprocess.Popen(["strace", "-f", "-c", "-e", f"trace={WRITES}", "-o", str(out),
                               "-p", str(pid)], stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached to every thread
    try:
        drive(checks)
    finally:
        tracer.send_signal(signal.SIGINT)
        return_code = tracer.wait(30)
    if return_code not in (0, -signal.SIGINT):
        raise RuntimeError(f"strace exited {return_code}")
    calls = 0
    for line in out.read_text().splitlines():
        parts = line.split()
        if parts and parts[-1] in WRITES.split(",") and len(parts) >= 4:
            calls += int(parts[3])
    return calls / checks


def measure(store: str, redis_url: str | None, checks: int, connections: int, pipeline: int,
            warmup: int, tmp: Path, callgrind: bool,
            trace: bool) -> tuple[float | None, float | None, tuple[float, float]]:
    run = f"{store}-{pipeline}"

    def drive(n: int) -> None:
        load(port, n, connections, pipeline)

    writes = ins = None
    port = free_port()
    proc = start(port, redis_url, [], tmp / f"{run}.log")
    try:
        wait_serving(port, 30)
        cpu = cpu_per_check(proc, drive, checks, warmup)
        if trace:
            writes = writes_per_check(proc.pid, drive, checks, tmp / f"strace.{run}")
    finally:
        stop(proc)
    if callgrind:
        port = free_port()
        out = tmp / f"callgrind.{run}.out"
        proc = start(port, redis_url, [*CALLGRIND, f"--callgrind-out-file={out}"], tmp / f"{run}.cg.log")
        try:
            wait_serving(port, 300)
        except BaseException:
            stop(proc)
            raise
        ins = instructions_per_check(proc, out, drive, checks, warmup)
    return writes, ins, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checks", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--pipeline", default="1,8", help="requests in flight per connection, comma-separated")
    ap.add_argument("--stores", default="memory,redis")
    ap.add_argument("--no-callgrind", action="store_true")
    ap.add_argument("--no-strace", action="store_true")
    args = ap.parse_args(argv)
    tools = ["h2load", *(() if args.no_callgrind else ("valgrind", "callgrind_control")),
             *(() if args.no_strace else ("strace",))]
    for tool in tools:
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found")
    rows = []
    with tempfile.TemporaryDirectory(prefix="corked-") as d:
        tmp = Path(d)
        for store in args.stores.split(","):
            redis = RedisServer(free_port()).start() if store == "redis" else None
            try:
                for pipeline in (int(p) for p in args.pipeline.split(",")):
                    writes, ins, cpu = measure(store, None if redis is None else redis.url, args.checks,
                                               args.connections, pipeline, args.warmup, tmp,
                                               not args.no_callgrind, not args.no_strace)
                    rows.append((store, pipeline, writes, ins, cpu))
                    print(f"{store} pipeline {pipeline}: {writes} writes, {ins} instructions, "
                          f"{sum(cpu):.1f} us CPU per check", file=sys.stderr)
            finally:
                if redis is not None:
                    redis.stop()
    print(f"\n{args.checks} checks over {args.connections} HTTP/1.1 connections (h2load --h1), "
          f"after {args.warmup} not counted; policy {POLICY.name}\n")
    print("| store | requests in flight per connection | socket writes per check | "
          "user-space instructions per check | server CPU us per check (user + system) |")
    print("|---|---:|---:|---:|---:|")
    for store, pipeline, writes, ins, cpu in rows:
        print(f"| {store} | {pipeline} | {'-' if writes is None else f'{writes:.2f}'} | "
              f"{'-' if ins is None else f'{ins:,.0f}'} | {sum(cpu):.0f} ({cpu[0]:.0f} + {cpu[1]:.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
