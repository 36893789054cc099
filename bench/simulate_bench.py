"""How fast ``extauthz simulate`` replays, where the time goes, and what ``--record`` costs.

    python -m bench.simulate_bench                 # 300k requests, policies/api.yaml
    python -m bench.simulate_bench --smoke         # 20k requests (CI proves it runs)
    python -m bench.simulate_bench --profile       # + cProfile split by layer

Prints requests replayed per second for:

* ``file``: the whole command path (read a gzip file, parse JSON, reorder, replay, tally);
* ``replay``: replay only, requests already parsed (run_now: no event loop);
* ``replay_asyncio``: the same lane driven inside one asyncio event loop run
  (``await engine.decide``), to compare with run_now;
* ``baseline``: two policies in lockstep (candidate + baseline);

and the recorder's cost per check on the event loop (``decided`` + ``finished``) and per
line in its writer thread (JSON + gzip + write). Figures are wall time and CPU time of this
process; on a shared machine take them on a quiet one, several rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import heapq
import io
import json
import pstats
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extauthz.commands.simulate.replay import Lane, Replay, run_now
from extauthz.commands.simulate.traffic import BadLines, Request, TrafficFile, read_traffic
from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.observe.record import Recorder
from extauthz.policy import load_policy
from extauthz.store.memory import MemoryStore
from testinfra.probes import write_lines

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_732_420_000.0


def traffic(n: int, users: int, rate: float, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` requests at ``rate``/s over ``users`` keys (a few heavy ones), mixed tiers."""
    rng = random.Random(seed)
    out = []
    t = T0
    for i in range(n):
        t += rng.expovariate(rate)
        u = int(rng.paretovariate(1.2)) % users
        key = f"sk_{'test' if u % 50 == 0 else 'live'}_{u}"
        if i % 10 == 0:
            method, path = "POST", "/v1/charges"
        elif i % 3 == 0:
            method, path = "POST", "/v1/customers"
        else:
            method, path = "GET", "/v1/customers"
        out.append({"time": round(t, 6), "method": method, "path": path, "host": "api.example.com",
                    "headers": {"x-api-key": key}, "duration": round(rng.lognormvariate(-3, 1), 6)})
    return out


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def replay_asyncio(policy: Any, reqs: list[Request]) -> None:
    """Lane.step with ``await engine.decide`` inside one event loop run, instead of run_now."""
    lane = Lane("candidate", policy)

    async def loop() -> None:
        lane.start(reqs[0].time)
        releases = lane._releases
        for seq, req in enumerate(reqs):
            t = req.time
            if (releases and releases[0][0] <= t) or lane._next_sample <= t:
                lane._until(t)
            lane.clock.now = t
            ctx = lane.context(req)
            decision = await lane.engine.decide(ctx)
            if decision.leases and req.duration is not None:
                heapq.heappush(releases, (t + req.duration, seq, decision.leases, decision.lease_id))
            lane.tally.add(ctx, decision)

    asyncio.run(loop())


def record_cost(policy: Any, n: int) -> dict[str, float]:
    clock = ManualClock(T0)
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(d, clock=clock)
        engine = Engine(StoreGate(MemoryStore(clock), clock=clock), policy)
        raws = [RawRequest("GET", "/v1/customers", "h", {"x-api-key": f"k{i % 500}"}, request_id=f"r{i}")
                for i in range(n)]
        pairs = [run_now(engine.check(r)) for r in raws]
        _, without = timed(lambda: [run_now(engine.check(r)) for r in raws])

        def hooks() -> None:
            for ctx, decision in pairs:
                rec.decided(ctx, decision, policy)
            for i in range(n):
                rec.finished(f"r{i}", 0.01)

        _, cpu_hooks = timed(hooks)
        lines = rec.take()
        _, cpu_write = timed(lambda: rec.writer.write(lines))
        size = rec.writer.bytes_written
    return {"check_us_without_recorder": without / n * 1e6, "recorder_hooks_us_per_check": cpu_hooks / n * 1e6,
            "writer_thread_us_per_line": cpu_write / n * 1e6, "compressed_bytes_per_line": size / n}


def profile_split(policy: Any, reqs: list[Request]) -> str:
    prof = cProfile.Profile()
    prof.enable()
    Replay(policy).run(reqs)
    prof.disable()
    stats = pstats.Stats(prof)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())  # tottime
    layers = {"engine.decide (limiters, verdicts)": ("engine.py", "limiters/", "verdict.py", "policy/model.py"),
              "embedded store": ("store/memory.py",), "classifier (identity hash, tier)": ("classify.py",),
              "replay bookkeeping (events, tally)": ("simulate/replay.py",)}
    out = {name: 0.0 for name in layers}
    other = 0.0
    for (filename, _, _), v in raw.items():
        for name, parts in layers.items():
            if any(p in filename for p in parts):
                out[name] += v[2]
                break
        else:
            other += v[2]
    out["other (builtins, dataclass init, heapq, os.urandom)"] = other
    buf = io.StringIO()
    for name, t in sorted(out.items(), key=lambda kv: -kv[1]):
        buf.write(f"  {t / total:6.1%}  {name}\n")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300_000)
    ap.add_argument("--users", type=int, default=5_000)
    ap.add_argument("--rate", type=float, default=2_000.0, help="traffic's own request rate (req/s)")
    ap.add_argument("--policies", default=str(ROOT / "policies"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="20k requests, one round")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.rounds = 20_000, 1
    policy = load_policy([args.policies])
    baseline_doc = (Path(args.policies) / "api.yaml") if Path(args.policies).is_dir() else Path(args.policies)
    lines = traffic(args.requests, args.users, args.rate)
    results: dict[str, Any] = {"requests": args.requests, "policy": args.policies}
    with tempfile.TemporaryDirectory() as d:
        path = write_lines(Path(d) / "traffic.jsonl.gz", lines)
        reqs = list(read_traffic([TrafficFile(path)], bad=BadLines()))
        base_dir = Path(d) / "baseline"
        base_dir.mkdir()
        (base_dir / "api.yaml").write_text(baseline_doc.read_text().replace("burst: 500", "burst: 200"))
        baseline = load_policy([base_dir])
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in
                                                      ("file", "replay", "replay_asyncio", "baseline")}
        for _ in range(args.rounds):
            runs["file"].append(timed(lambda: Replay(policy).run(
                read_traffic([TrafficFile(path)], bad=BadLines()))))
            runs["replay"].append(timed(lambda: Replay(policy).run(reqs)))
            runs["replay_asyncio"].append(timed(lambda: replay_asyncio(policy, reqs)))
            runs["baseline"].append(timed(lambda: Replay(policy, baseline).run(reqs)))
        print(f"{args.requests:,} requests, {args.users:,} users, policy {args.policies} "
              f"(median of {args.rounds}; wall / CPU):")
        for name, samples in runs.items():
            wall = sorted(s[0] for s in samples)[len(samples) // 2]
            cpu = sorted(s[1] for s in samples)[len(samples) // 2]
            results[name] = {"wall_req_per_s": rate(args.requests, wall), "cpu_req_per_s": rate(args.requests, cpu)}
            print(f"  {name:<15} {rate(args.requests, wall):>10,.0f} req/s wall  "
                  f"{rate(args.requests, cpu):>10,.0f} req/s CPU")
        cost = record_cost(policy, min(args.requests, 50_000))
        results["record"] = cost
        print("serve --record cost (CPU):")
        print(f"  a check without the recorder          {cost['check_us_without_recorder']:6.1f} us")
        print(f"  recorder hooks on the event loop      {cost['recorder_hooks_us_per_check']:6.1f} us per check")
        print(f"  writer thread (JSON + gzip + write)   {cost['writer_thread_us_per_line']:6.1f} us per line, "
              f"{cost['compressed_bytes_per_line']:.0f} bytes per line compressed")
        if args.profile:
            split = profile_split(policy, reqs[: min(len(reqs), 100_000)])
            results["profile"] = split
            print("where replay time goes (cProfile, own time by layer):\n" + split)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
