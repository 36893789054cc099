"""Store deadlines missed, and where (issue 29): the engine on Redis or a 3-master Cluster at
several ``--store-deadline-ms`` values.

    .venv/bin/python -m bench.deadline                               # single Redis
    .venv/bin/python -m bench.deadline --topology cluster            # 3-master Cluster
    .venv/bin/python -m bench.deadline --topology cluster --deadlines 5,10,20,50 --rounds 3
    .venv/bin/python -m bench.deadline --keys 1 --policy all-on-batched   # one hot key

``--concurrency`` callers (32) run ``Engine.check`` for ``--seconds`` each round (after a
warm-up that opens the connections and loads the scripts), every admitted request's leases
released right after its answer, as the access log does. Per deadline it prints checks/s,
the fail-opens by reason as a share of checks (``timeout``; ``circuit_open``: the breaker
was open), and every passed deadline by where the check was
(``extauthz_store_deadline_missed_total``): ``redis`` (written at least a deadline before and
unanswered: the store late), ``queued`` (not written yet, or written less than a deadline
before) and ``loop`` (answered, not carried to the check yet): counts, not timings. Rounds
interleave the deadlines; the table sums the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extauthz.core.context import RawRequest
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.policy import load_policy
from extauthz.store.redis import RedisStore
from testinfra.redis_servers import start_cluster, start_single

from .configs import POLICIES


async def one_run(url: str, policy: Path, deadline: float, seconds: float, concurrency: int,
                  keys: int) -> dict[str, Any]:
    store = RedisStore.from_url(url, deadline=deadline)
    engine = Engine(StoreGate(store, deadline), load_policy([policy]))
    try:
        await store.ping()
        for _ in range(300):  # warm-up: connections, scripts, the cluster's slot map
            _, d = await engine.check(RawRequest(method="GET", path="/x", headers={"x-api-key": "warm"}))
            if d.leases:
                engine.releaser.release(d.leases, d.lease_id, "access_log")
        engine.failures.clear()
        engine.gate.deadline_missed = dict.fromkeys(engine.gate.deadline_missed, 0)
        checks = refused = 0
        end = time.monotonic() + seconds

        async def caller(i: int) -> None:
            nonlocal checks, refused
            k = i
            while time.monotonic() < end:
                k += concurrency
                raw = RawRequest(method="GET", path="/x", headers={"x-api-key": f"bench-user-{k % keys}"})
                _, d = await engine.check(raw)
                checks += 1
                refused += not d.allowed
                if d.leases:
                    engine.releaser.release(d.leases, d.lease_id, "access_log")

        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        await engine.releaser.drain()
        return {"checks": checks, "refused": refused, "seconds": seconds, "failures": dict(engine.failures),
                "missed": dict(engine.gate.deadline_missed), "breaker": engine.gate.breaker_state}
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.deadline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", choices=["single", "cluster"], default="single")
    p.add_argument("--deadlines", default="5,10,20,50", help="store deadlines, ms (default 5,10,20,50)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--keys", type=int, default=1000, help="API keys rotated over (1: one hot key)")
    p.add_argument("--policy", default="all-on", help="a policy of bench/policies (default all-on: (d)'s)")
    args = p.parse_args(argv)
    deadlines = [float(x) for x in args.deadlines.split(",")]
    runner: Callable[[Any], Any] = asyncio.run
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        pass
    tmp = Path(tempfile.mkdtemp(prefix="deadline-bench-"))
    handle: Any = start_single(tmp) if args.topology == "single" else start_cluster(tmp)
    totals: dict[float, dict[str, Any]] = {}
    try:
        for rnd in range(args.rounds):
            for ms in deadlines:
                r = runner(one_run(handle.url, POLICIES / f"{args.policy}.yaml", ms / 1000, args.seconds,
                                   args.concurrency, args.keys))
                print(f"round {rnd + 1} deadline {ms:g} ms: {r['checks'] / r['seconds']:,.0f} checks/s "
                      f"fail-open {r['failures']} deadlines passed {r['missed']} breaker {r['breaker']}",
                      flush=True)
                t = totals.setdefault(ms, {"checks": 0, "refused": 0, "failures": {}, "missed": {}})
                t["checks"] += r["checks"]
                t["refused"] += r["refused"]
                for name in ("failures", "missed"):
                    for k, v in r[name].items():
                        t[name][k] = t[name].get(k, 0) + v
    finally:
        handle.stop()
    print()
    print(f"Redis {args.topology}, policy {args.policy}, {args.keys} key(s), {args.concurrency} callers, "
          f"{args.rounds} round(s) of {args.seconds:g} s, summed:")
    print()
    print("| deadline | checks | timeout | circuit_open | deadlines passed: redis / queued / loop | refused |")
    print("|---:|---:|---:|---:|---|---:|")
    for ms, t in totals.items():
        n = max(1, t["checks"])
        f, m = t["failures"], t["missed"]
        print(f"| {ms:g} ms | {t['checks']:,} | {f.get('timeout', 0)} ({f.get('timeout', 0) / n * 100:.2f}%) "
              f"| {f.get('circuit_open', 0)} ({f.get('circuit_open', 0) / n * 100:.2f}%) "
              f"| {m.get('redis', 0)} / {m.get('queued', 0)} / {m.get('loop', 0)} | {t['refused']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
