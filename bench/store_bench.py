"""Store benchmark: Check throughput and latency through the Engine, embedded vs Redis.

    .venv/bin/python -m bench.store_bench                 # ~1 min: 3 rounds, single Redis
    .venv/bin/python -m bench.store_bench --quick         # one short round
    .venv/bin/python -m bench.store_bench --topology cluster --memory

It starts its own throwaway ``redis-server`` (``testinfra/redis_servers.py``), then runs,
in interleaved rounds (the machine is noisy: the table shows medians per configuration):

  memory        the embedded store
  redis         the Redis store, one EVALSHA per check (batching off)
  redis+batch   the Redis store, checks of one event-loop iteration pipelined together
  redis-py+batch  the same as before this round: redis-py's own connections instead of the
                lean client path (``extauthz/store/redis/conn.py``; bench/redispy_store.py), releases sent on their
                own instead of riding with the next check: before/after in one run

each at 1 and at ``--concurrency`` concurrent callers, every check through
``Engine.check`` with the policy below (the default policy's three store-backed limiters:
token bucket, per-user concurrency lease, fleet lease), users rotating over 10,000 API keys.

Round trips are counted per store-backed check (fail-opens excluded), on both sides:
Redis's ``total_reads_processed`` (``INFO stats``; one socket read per request or
pipeline, the INFO calls themselves subtracted), EVALSHA
calls from ``INFO commandstats``, and the store's own counter (``RedisStore.stats``); so are
Redis commands of every kind (``INFO commandstats``, the commands inside scripts included). Without
batching a check must be exactly 1 round trip and 1 EVALSHA (the script reloads after the
first NOSCRIPT are excluded by a warm-up).

``--flood`` measures instead a flood through the engine on Redis (one ``request_rate``
limiter, rate 50/s): one key sends half of all checks (about 50x its rate at the
throughput here), the other half rotates over 1,000 well-behaved keys; against the same
run without the flooding key, and with the refusal cache off (every refusal asks Redis).
It prints throughput, EVALSHA per check and the well-behaved keys' p99.

``--memory`` also measures the memory per active user (``MEMORY USAGE`` and ``used_memory``
over 10,000 users with the rate and concurrency limiters).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from extauthz.core.context import RawRequest  # noqa: E402
from extauthz.engine.engine import Engine  # noqa: E402
from extauthz.engine.storegate import StoreGate  # noqa: E402
from extauthz.policy import load_policy  # noqa: E402
from extauthz.store.base import Store  # noqa: E402
from extauthz.store.memory import MemoryStore  # noqa: E402
from extauthz.store.redis import RedisStore  # noqa: E402
from testinfra.redis_servers import start_cluster, start_single  # noqa: E402

from .redispy_store import RedisPyStore  # noqa: E402

POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-rate
    type: request_rate
    rate: 100
    burst: 500
  - name: user-concurrency
    type: concurrent_requests
    limit: 20
    lease_ttl: 5s
  - name: fleet
    type: fleet_usage
    capacity: 100000000
    reserved_for_critical: 0.2
    lease_ttl: 5s
"""
USERS = 10_000


@dataclass
class Run:
    config: str
    concurrency: int
    checks: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    cpu: float = 0.0
    redis_cpu: float | None = None
    evalsha: int | None = None
    commands: int | None = None
    reads: int | None = None
    client_round_trips: int | None = None

    @property
    def rate(self) -> float:
        return self.checks / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def redis_counters(clients: list[redis.Redis]) -> tuple[int, int, float, int]:
    """(EVALSHA calls, socket reads, CPU seconds, commands but INFO) summed over masters."""
    evalsha = reads = commands = 0
    cpu = 0.0
    for c in clients:
        stats = c.info("commandstats")
        evalsha += int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
        commands += sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")
        reads += int(c.info("stats")["total_reads_processed"])
        info = c.info("cpu")
        cpu += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return evalsha, reads, cpu, commands


async def drive(engine: Engine, run: Run, seconds: float) -> None:
    """``run.concurrency`` callers checking in a loop; every admitted request's leases are
    released right after its answer, in the background (as the access log does), so that
    round trips and commands per check include the releases."""
    counter = 0
    stop = time.perf_counter() + seconds
    releases: set[asyncio.Task[Any]] = set()

    async def caller() -> None:
        nonlocal counter
        while time.perf_counter() < stop:
            counter += 1
            raw = RawRequest("GET", "/v1/items", headers={"x-api-key": f"k{counter % USERS}"})
            t0 = time.perf_counter()
            _, decision = await engine.check(raw)
            run.latencies.append(time.perf_counter() - t0)
            run.failures += bool(decision.failures)
            if decision.leases:
                task = asyncio.ensure_future(engine.store.release(decision.leases, decision.lease_id))
                releases.add(task)
                task.add_done_callback(releases.discard)

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(caller() for _ in range(run.concurrency)))
    await asyncio.gather(*releases, return_exceptions=True)
    run.seconds = time.perf_counter() - started
    run.cpu = time.process_time() - cpu
    run.checks = len(run.latencies)


async def one_run(config: str, concurrency: int, seconds: float, url: str | None,
                  clients: list[redis.Redis], policy_path: Path, deadline: float) -> Run:
    policy = load_policy([policy_path])
    store: Store
    if config == "memory":
        store = MemoryStore()
    else:
        kind = RedisPyStore if config.startswith("redis-py") else RedisStore
        store = kind.from_url(url or "", deadline=deadline, batching=config.endswith("+batch"),
                              releases_ride=not config.startswith("redis-py"))
    engine = Engine(StoreGate(store, deadline), policy)
    run = Run(config, concurrency)
    try:
        # Warm up with a generous deadline (connections opened, scripts loaded): a
        # fail-open there would open the circuit breaker for the measured run.
        engine.gate.deadline = 5.0
        await drive(engine, Run(config, concurrency), 0.2)
        engine.gate.deadline = deadline
        engine.failures.clear()
        if isinstance(store, RedisStore):
            before = redis_counters(clients)
            trips = store.stats.round_trips
        await drive(engine, run, seconds)
        if isinstance(store, RedisStore):
            after = redis_counters(clients)
            run.evalsha = after[0] - before[0]
            run.commands = after[3] - before[3]
            # each INFO call is one read of its own: 3 per master per counter sample
            run.reads = after[1] - before[1] - 3 * len(clients)
            run.redis_cpu = after[2] - before[2]
            run.client_round_trips = store.stats.round_trips - trips
    finally:
        await store.close()
    return run


FLOOD_POLICY = """\
version: 1
identity:
  - header: x-api-key
limiters:
  - name: user-rate
    type: request_rate
    rate: 50
    burst: 50
"""
FLOOD_RATE = 50.0


async def flood_run(mode: str, url: str, clients: list[redis.Redis], policy_path: Path,
                    seconds: float, concurrency: int) -> dict[str, float]:
    """``mode``: ``flood`` (cache on), ``flood-nocache``, or ``calm`` (no flooding key)."""
    from extauthz.limiters import RequestRateLimiter

    store = RedisStore.from_url(url, deadline=1.0)
    engine = Engine(StoreGate(store, 1.0), load_policy([policy_path]))
    if mode == "flood-nocache":
        for lim in engine.snapshot.limiters:
            if isinstance(lim, RequestRateLimiter):
                lim.refusals = None
    calm: list[float] = []
    counts = {"checks": 0, "flood": 0, "refused": 0}
    try:
        await engine.check(RawRequest("GET", "/", headers={"x-api-key": "warm"}))
        before = redis_counters(clients)
        stop = time.perf_counter() + seconds
        n = 0

        async def caller() -> None:
            nonlocal n
            while time.perf_counter() < stop:
                n += 1
                flood = mode != "calm" and n % 2 == 0
                key = "flood" if flood else f"k{n % 1000}"
                t0 = time.perf_counter()
                _, d = await engine.check(RawRequest("GET", "/", headers={"x-api-key": key}))
                if not flood:
                    calm.append(time.perf_counter() - t0)
                counts["checks"] += 1
                counts["flood"] += flood
                counts["refused"] += not d.allowed

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        after = redis_counters(clients)
    finally:
        await store.close()
    calm.sort()
    return {"rate": counts["checks"] / elapsed, "evalsha": (after[0] - before[0]) / counts["checks"],
            "p99": calm[int(0.99 * (len(calm) - 1))] * 1e3, "cpu": cpu / counts["checks"] * 1e6,
            "factor": counts["flood"] / elapsed / FLOOD_RATE, "refused": counts["refused"] / counts["checks"]}


def flood_main(args: argparse.Namespace, runner: Callable[[Any], Any]) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="store-bench-flood-"))
    policy_path = tmp / "policy.yaml"
    policy_path.write_text(FLOOD_POLICY)
    handle = start_single(tmp)
    clients = [handle.client(decode_responses=False)]
    rows: dict[str, list[dict[str, float]]] = {}
    try:
        for rnd in range(args.rounds):
            for mode in ("calm", "flood", "flood-nocache"):
                clients[0].flushall()
                fig = runner(flood_run(mode, handle.url, clients, policy_path, args.seconds,
                                       args.concurrency))
                rows.setdefault(mode, []).append(fig)
                print(f"round {rnd + 1}: {mode:14} {fig['rate']:9,.0f} checks/s, EVALSHA/check "
                      f"{fig['evalsha']:.3f}, well-behaved p99 {fig['p99']:.3f} ms", flush=True)
    finally:
        clients[0].close()
        handle.stop()
    print()
    print(f"Flood, {args.concurrency} callers, {args.rounds} round(s) of {args.seconds:g} s, medians:")
    print("| run | checks/s | vs calm | EVALSHA/check | refused | flood x its rate | "
          "client CPU us/check | well-behaved p99 ms | p99 vs calm |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in rows.items()}
    for mode, f in med.items():
        print(f"| {mode} | {f['rate']:,.0f} | {f['rate'] / med['calm']['rate']:.2f}x | "
              f"{f['evalsha']:.3f} | {f['refused']:.1%} | {f['factor']:.0f} | {f['cpu']:.1f} | "
              f"{f['p99']:.3f} | {f['p99'] / med['calm']['p99']:.2f}x |")
    return 0


def per_node(handle: Any, clients: list[redis.Redis]) -> str:
    """Redis Cluster: script calls and Redis CPU per master over the whole benchmark."""
    fleet_slot = key_slot(b"{fleet}")
    fleet_port = next(int(master[1]) for start, end, master, *_ in clients[0].execute_command("CLUSTER SLOTS")
                      if int(start) <= fleet_slot <= int(end))
    lines = ["| master | holds {fleet} | EVALSHA calls | usec/call | share of calls |",
             "|---|---|---|---|---|"]
    stats = []
    for node, c in zip(handle.nodes, clients, strict=True):
        st = c.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec_per_call": 0.0})
        stats.append((node.port, int(st["calls"]), float(st["usec_per_call"])))
    total = sum(calls for _, calls, _ in stats) or 1
    for port, calls, usec in stats:
        owner = "yes" if port == fleet_port else ""
        lines.append(f"| :{port} | {owner} | {calls:,} | {usec:.1f} | {calls / total:.0%} |")
    return "\n".join(lines)


def table(runs: list[Run]) -> str:
    groups: dict[tuple[str, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.config, r.concurrency), []).append(r)
    memory_rate = {c: statistics.median(x.rate for x in rs)
                   for (cfg, c), rs in groups.items() if cfg == "memory"}
    lines = [
        "| store | callers | checks/s | vs memory | p50 ms | p99 ms | client CPU us/check | "
        "Redis CPU us/check | fail-open | EVALSHA/check | Redis commands/check | "
        "round trips/check (Redis reads) | (client count) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (cfg, c), rs in groups.items():
        rate = statistics.median(r.rate for r in rs)
        p50 = statistics.median(r.pct(0.5) for r in rs)
        p99 = statistics.median(r.pct(0.99) for r in rs)
        fails = sum(r.failures for r in rs) / max(1, sum(r.checks for r in rs))
        if rs[0].evalsha is None:
            per = "-", "-", "-", "-"
        else:
            n = sum(r.checks - r.failures for r in rs)  # store-backed checks
            per = (f"{sum(r.evalsha or 0 for r in rs) / n:.3f}",
                   f"{sum(r.commands or 0 for r in rs) / n:.2f}",
                   f"{sum(r.reads or 0 for r in rs) / n:.3f}",
                   f"{sum(r.client_round_trips or 0 for r in rs) / n:.3f}")
        ratio = f"{rate / memory_rate[c]:.2f}x" if c in memory_rate else "-"
        cpu = statistics.median(r.cpu / r.checks * 1e6 for r in rs)
        rcpu = ("-" if rs[0].redis_cpu is None else
                f"{statistics.median((r.redis_cpu or 0) / r.checks * 1e6 for r in rs):.1f}")
        lines.append(f"| {cfg} | {c} | {rate:,.0f} | {ratio} | {p50:.3f} | {p99:.3f} | {cpu:.1f} | "
                     f"{rcpu} | {fails:.1%} | {per[0]} | {per[1]} | {per[2]} | {per[3]} |")
    return "\n".join(lines)


async def measure_memory(url: str, clients: list[redis.Redis], policy_path: Path) -> str:
    """Memory per active user: the default policy's rate and concurrency limiters."""
    for c in clients:
        c.flushall()
    policy = load_policy([policy_path])
    store = RedisStore.from_url(url, deadline=1.0)
    engine = Engine(StoreGate(store, 1.0), policy)
    used_before = sum(int(c.info("memory")["used_memory"]) for c in clients)
    try:
        for start in range(0, USERS, 500):
            await asyncio.gather(*(
                engine.check(RawRequest("GET", "/", headers={"x-api-key": f"user-{i}"}))
                for i in range(start, start + 500)))
    finally:
        await store.close()
    used_after = sum(int(c.info("memory")["used_memory"]) for c in clients)
    per_kind: dict[str, list[int]] = {}
    for c in clients:
        for key in c.scan_iter(match="extauthz:{u:*", count=1000):
            kind = key.split(b"}:")[1].split(b":")[0].decode()
            per_kind.setdefault(kind, []).append(int(c.memory_usage(key, samples=0) or 0))
    lines = [f"memory per active user over {USERS:,} users (rate + concurrency limiters):"]
    total = 0.0
    for kind, sizes in sorted(per_kind.items()):
        avg = sum(sizes) / len(sizes)
        total += avg * len(sizes) / USERS
        lines.append(f"  {kind}: {len(sizes):,} keys, MEMORY USAGE {avg:.0f} B each")
    lines.append(f"  MEMORY USAGE per user: {total:.0f} B")
    lines.append(f"  used_memory delta per user: {(used_after - used_before) / USERS:.0f} B "
                 "(includes the keyspace and expires dicts)")
    for c in clients:
        c.flushall()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="per configuration and round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--deadline-ms", type=float, default=1000.0,
                        help="engine store deadline: generous, a fail-open would flatter Redis "
                        "(queueing at saturation takes a check past the production 5 ms)")
    parser.add_argument("--topology", choices=["single", "cluster"], default="single")
    parser.add_argument("--memory", action="store_true", help="also measure memory per user")
    parser.add_argument("--quick", action="store_true", help="one round of 1 s")
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument("--flood", action="store_true", help="the flood measurement (see above)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 1, 1.0

    runner: Callable[[Any], Any] = asyncio.run
    if not args.no_uvloop:
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            pass
    if args.flood:
        return flood_main(args, runner)
    tmp = Path(tempfile.mkdtemp(prefix="store-bench-"))
    policy_path = tmp / "policy.yaml"
    policy_path.write_text(POLICY)
    handle: Any = start_single(tmp) if args.topology == "single" else start_cluster(tmp)
    clients: list[redis.Redis] = (
        [handle.client(decode_responses=False)] if args.topology == "single"
        else [handle.node_client(i, decode_responses=False) for i in range(len(handle.nodes))])
    try:
        runs: list[Run] = []
        configs = ["memory", "redis", "redis+batch", "redis-py+batch"]
        for rnd in range(args.rounds):
            for concurrency in (1, args.concurrency):
                for config in configs:
                    for c in clients:
                        c.flushall()
                    run = runner(one_run(config, concurrency, args.seconds, handle.url, clients,
                                         policy_path, args.deadline_ms / 1000))
                    runs.append(run)
                    print(f"round {rnd + 1}: {config:14} x{concurrency:<3} {run.rate:9,.0f} checks/s "
                          f"p50 {run.pct(0.5):.3f} ms p99 {run.pct(0.99):.3f} ms", flush=True)
        print()
        print(f"Redis {args.topology} ({'uvloop' if runner is not asyncio.run else 'asyncio'}), "
              f"{args.rounds} round(s) of {args.seconds:g} s, medians:")
        print(table(runs))
        if args.topology == "cluster":
            print()
            print(per_node(handle, clients))
        if args.memory:
            print()
            print(runner(measure_memory(handle.url, clients, policy_path)))
    finally:
        for c in clients:
            c.close()
        handle.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
