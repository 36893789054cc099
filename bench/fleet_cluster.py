"""Fleet checks per second on a real 3-master Redis Cluster, exact vs batched (issue 24 item 5).

    .venv/bin/python -m bench.fleet_cluster                  # 3 rounds of 3 s, 32 callers
    .venv/bin/python -m bench.fleet_cluster --quick          # one round of 1 s
    .venv/bin/python -m bench.fleet_cluster --json FILE

A ``fleet_usage`` limiter alone (one fleet counter: one hash slot, so one master holds it
whatever the cluster's size) is checked through ``Engine.check`` on a ``RedisStore`` over the
cluster (checks of one loop turn batched, as served), by ``--concurrency`` callers, every
admitted request's lease released right after its answer (as the access log does):

  exact    every check asks the fleet counter (``consistency: exact``, the default)
  batched  a replica takes fleet slots in grants and asks once per grant
           (``consistency: batched``)

The table (bench/store_bench.py ``table``) shows checks/s, client and Redis CPU per check and
EVALSHA per check summed over the masters; the per-master table shows which master holds
``{fleet}`` and its share of the script calls. Rounds are interleaved; medians. One client
process is the ceiling here (the client, not Redis, is the limit on this machine: see
docs/benchmarks.md); what scales with masters is the Redis side, read from the per-master
figures. docs/scaling.md uses these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .store_bench import Run, one_run, per_node, start_cluster, table

FLEET = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: fleet
    type: fleet_usage
    capacity: 100000000
    reserved_for_critical: 0.2
    lease_ttl: 5s
"""
MODES = ("exact", "batched")


def policy_text(mode: str) -> str:
    return FLEET if mode == "exact" else FLEET + "    consistency: batched\n"


def summary(runs: list[Run]) -> dict[str, Any]:
    """Per mode: median checks/s and EVALSHA per store-backed check over the rounds."""
    out: dict[str, Any] = {}
    for mode in {r.config for r in runs}:
        rs = [r for r in runs if r.config == mode]
        checks = sum(r.checks - r.failures for r in rs) or 1
        out[mode] = {
            "checks_per_s": statistics.median(r.rate for r in rs),
            "evalsha_per_check": sum(r.evalsha or 0 for r in rs) / checks,
            "client_cpu_us": statistics.median(r.cpu / r.checks * 1e6 for r in rs if r.checks),
            "redis_cpu_us": statistics.median((r.redis_cpu or 0) / r.checks * 1e6 for r in rs if r.checks),
            "fail_open": sum(r.failures for r in rs),
            "rounds": [round(r.rate) for r in rs],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per mode and round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--deadline-ms", type=float, default=1000.0,
                        help="engine store deadline (generous: a fail-open would flatter Redis)")
    parser.add_argument("--quick", action="store_true", help="one round of 1 s")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 1, 1.0
    runner: Callable[[Any], Any] = asyncio.run
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="fleet-cluster-"))
    paths = {}
    for mode in MODES:
        paths[mode] = tmp / f"fleet-{mode}.yaml"
        paths[mode].write_text(policy_text(mode))
    run_modes = MODES
    handle = start_cluster(tmp, masters=args.masters)
    clients = [handle.node_client(i, decode_responses=False) for i in range(len(handle.nodes))]
    runs: list[Run] = []
    try:
        for rnd in range(args.rounds):
            for mode in run_modes:
                for c in clients:
                    c.flushall()
                run = runner(one_run("redis+batch", args.concurrency, args.seconds, handle.url, clients,
                                     paths[mode], args.deadline_ms / 1000))
                run.config = mode
                runs.append(run)
                print(f"round {rnd + 1}: fleet {mode:8} x{args.concurrency:<3} {run.rate:9,.0f} checks/s "
                      f"EVALSHA/check {(run.evalsha or 0) / max(1, run.checks - run.failures):.3f} "
                      f"fail-open {run.failures}", flush=True)
        print()
        print(f"Redis Cluster, {args.masters} masters, {args.rounds} round(s) of {args.seconds:g} s, "
              f"{args.concurrency} callers, medians:")
        print(table(runs))
        print()
        print(per_node(handle, clients))
        figures = summary(runs)
        if args.json is not None:
            args.json.write_text(json.dumps({"masters": args.masters, "concurrency": args.concurrency,
                                             "seconds": args.seconds, "modes": figures}, indent=2))
    finally:
        for c in clients:
            c.close()
        handle.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
