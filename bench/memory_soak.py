"""The server's memory over a long run at saturation (issue 31: flat within 10 % over 10
minutes with the access log on).

One stack as the harness builds it (bench/stack.py): Redis, the server, one Envoy with the
gRPC access log on (the lease release path), the four-limiter policy (its
``concurrent_requests`` limiter takes a lease per request, given back through the access
log), ``wrk -c32`` over 1,000 API keys for the whole run. Every ``--interval`` seconds it
samples the resident memory (VmRSS) of every server process, summed; after ``--warmup`` the
first sample is the start. It prints each sample, then the start, the end, the max after the
warm-up and their ratios to the start, and what wrk saw (requests, non-2xx, errors).

Memory is what is measured, not speed: the figures hold on a loaded machine too, as long as
the load saturates the server (wrk's requests/s is printed to show it did).

    python -m bench.memory_soak --minutes 10 --grpc-server asyncio
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from extauthz.devtools.stack import free_port

from .configs import SETUPS, Options, Setup
from .load import read_wrk, require_tools, wrk_cmd, wrk_script
from .procs import RedisServer
from .stack import Running

#: the four-limiter rows on Redis with the access log always on, by gRPC server
SETUP_OF = {"asyncio": "d-h2", "grpcio": "d"}


def rss_bytes(pids: Sequence[int]) -> int:
    """Resident memory of ``pids`` summed (0 for a process that is gone)."""
    total = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
                break
    return total


def grpc_state(admin_port: int) -> dict[str, Any]:
    """The gRPC port's own counts from admin ``/status`` (connections, calls it holds: a leak
    of calls shows here before it shows in memory); empty if unreachable."""
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"http://127.0.0.1:{admin_port}/status", timeout=2) as resp:
            status = json.load(resp)
    except (OSError, ValueError):
        return {}
    grpc = status.get("grpc") or {}
    return {k: grpc[k] for k in ("connections", "running", "calls") if k in grpc}


def summarize(samples: Sequence[tuple[float, int]], warmup: float) -> dict[str, float]:
    """Start (the first sample at or after ``warmup`` s), end, max after the warm-up, and the
    end and max as ratios of the start."""
    after = [(t, rss) for t, rss in samples if t >= warmup]
    if not after:
        raise ValueError(f"no sample after the {warmup} s warm-up: run longer")
    start, end, top = after[0][1], after[-1][1], max(rss for _, rss in after)
    return {"start_mib": start / 2**20, "end_mib": end / 2**20, "max_mib": top / 2**20,
            "end_ratio": end / start, "max_ratio": top / start, "samples": len(after),
            "measured_s": after[-1][0] - after[0][0]}


def soak(setup: Setup, *, seconds: float, warmup: float, interval: float, connections: int,
         workdir: Path) -> dict[str, Any]:
    require_tools(("wrk",))
    (workdir / "redis").mkdir()
    with RedisServer(free_port(), workdir / "redis") as redis:
        running = Running(setup, redis, Options(), workdir).start()
        try:
            assert running.access_log(), "the soak needs the access log on"
            script = wrk_script(workdir)
            total = warmup + seconds
            wrk = subprocess.Popen(wrk_cmd(running.url, total, script, threads=1, connections=connections),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            began = time.monotonic()
            samples: list[tuple[float, int]] = []
            while wrk.poll() is None:
                at = time.monotonic() - began
                rss = rss_bytes(running.server_pids())
                samples.append((at, rss))
                print(f"  {at:7.1f} s  server RSS {rss / 2**20:8.1f} MiB  gRPC port {grpc_state(running.admin_base)}",
                      flush=True)
                time.sleep(max(0.0, interval - (time.monotonic() - began - at)))
            out, err = wrk.communicate()
            samples.append((time.monotonic() - began, rss_bytes(running.server_pids())))
            print(f"memory: {json.dumps(summarize(samples, warmup))}", flush=True)  # whatever wrk says
            if wrk.returncode:
                raise RuntimeError(f"wrk exited {wrk.returncode}:\n{out}\n{err}")
            return {"setup": setup.key, "label": setup.label, "samples": samples,
                    "memory": summarize(samples, warmup), "wrk": read_wrk(out),
                    "fail_open": running.fail_open(),
                    "server_log_tail": running.server.log()[-1500:] if running.server else ""}
        finally:
            running.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc-server", choices=sorted(SETUP_OF), default="asyncio")
    p.add_argument("--minutes", type=float, default=10.0, help="measured minutes after the warm-up")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the start sample")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--connections", type=int, default=32, help="wrk connections")
    p.add_argument("--json", type=Path, help="write the samples and figures here")
    args = p.parse_args(argv)
    if not (args.minutes > 0 and args.warmup >= 0 and args.interval > 0 and args.connections > 0):
        p.error("--minutes, --interval and --connections must be positive, --warmup not negative")
    setup = replace(SETUPS[SETUP_OF[args.grpc_server]])
    print(f"memory soak: ({setup.key}) {setup.label}, access log on, wrk -c{args.connections}, "
          f"{args.warmup:.0f} s warm-up + {args.minutes:g} min", flush=True)
    with tempfile.TemporaryDirectory(prefix="extauthz-soak-") as tmp:
        result = soak(setup, seconds=args.minutes * 60, warmup=args.warmup, interval=args.interval,
                      connections=args.connections, workdir=Path(tmp))
    m, w = result["memory"], result["wrk"]
    print(f"server RSS: start {m['start_mib']:.1f} MiB, end {m['end_mib']:.1f} MiB, max {m['max_mib']:.1f} MiB; "
          f"end/start {m['end_ratio']:.3f}, max/start {m['max_ratio']:.3f} "
          f"({m['samples']} samples over {m['measured_s']:.0f} s after the warm-up)")
    print(f"wrk: {w['requests']:.0f} requests, {w['rps']:.0f} req/s, non-2xx {w['non_2xx']:.0f}, "
          f"socket errors {w['errors']:.0f}")
    print(f"server fail-open and overload counts: {result['fail_open']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
