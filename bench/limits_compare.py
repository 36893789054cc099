"""The Redis store's checks/s against the Python ``limits`` library's hits/s, same Redis, one run.

Both sides do the same job: one per-user rate limit decided in Redis for each request, from
``--concurrency`` asyncio tasks in one process (uvloop, as the server runs), over
``--users`` users, for ``--seconds`` each, alternating for ``--rounds`` rounds (medians).

* store: ``Engine.check()`` (classification, a ``request_rate`` limiter, the atomic
  ``check.lua`` script) on :class:`extauthz.store.redis.RedisStore` with its auto-batching
  (every check issued in one event-loop iteration goes out as one pipeline);
* limits: ``MovingWindowRateLimiter.hit()`` (``--strategy``) on ``async+redis://`` storage.

Limits are high, so neither refuses. Run alone with ``python -m bench.limits_compare``
(starts a throwaway redis-server) or ``--redis-url``; ``bench.harness`` runs it too.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from extauthz.core.context import RawRequest
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.policy import load_policy

POLICY = """
version: 1
identity: [{header: x-api-key}]
limiters:
  - name: user-rate
    type: request_rate
    rate: 1000000
    burst: 1000000
"""


async def _drive(seconds: float, concurrency: int, users: int,
                 one: Callable[[int], Awaitable[Any]]) -> tuple[int, float]:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal done
        i = offset
        while time.perf_counter() < stop:
            await one(i % users)
            i += concurrency
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done, time.perf_counter() - started


async def store_rate(url: str, seconds: float, concurrency: int, users: int) -> dict[str, float]:
    from extauthz.store.redis import RedisStore

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_text(POLICY)
        policy = load_policy([str(path)])
    store = RedisStore.from_url(url, deadline=1.0)
    engine = Engine(StoreGate(store, 1.0), policy)
    raws = [RawRequest(method="GET", path="/v1/items", headers={"x-api-key": f"user-{u}"})
            for u in range(users)]
    refused = 0

    async def one(u: int) -> None:
        nonlocal refused
        _, decision = await engine.check(raws[u])
        if not decision.allowed or decision.failures:
            refused += 1

    try:
        await _drive(0.5, concurrency, users, one)  # connect, load scripts
        trips0, checks0 = store.stats.round_trips, store.stats.commands
        done, elapsed = await _drive(seconds, concurrency, users, one)
        trips, commands = store.stats.round_trips - trips0, store.stats.commands - checks0
    finally:
        await store.close()
    if refused:
        raise RuntimeError(f"the store refused or failed {refused} checks: not a fair comparison")
    return {"per_s": done / elapsed, "round_trips_per_check": trips / max(1, done),
            "commands_per_check": commands / max(1, done)}


async def limits_rate(url: str, seconds: float, concurrency: int, users: int,
                      strategy: str) -> dict[str, float]:
    from limits import RateLimitItemPerSecond
    from limits.aio import strategies
    from limits.storage import storage_from_string

    storage = storage_from_string("async+" + url)
    limiter = getattr(strategies, strategy)(storage)
    item = RateLimitItemPerSecond(1_000_000)
    keys = [f"user-{u}" for u in range(users)]
    refused = 0

    async def one(u: int) -> None:
        nonlocal refused
        if not await limiter.hit(item, keys[u]):
            refused += 1

    await _drive(0.5, concurrency, users, one)
    done, elapsed = await _drive(seconds, concurrency, users, one)
    if refused:
        raise RuntimeError(f"limits refused {refused} hits: not a fair comparison")
    return {"per_s": done / elapsed}


async def _compare(url: str, seconds: float, concurrency: int, users: int, rounds: int,
                   strategy: str) -> dict[str, Any]:
    store, lim, trips = [], [], []
    for _ in range(rounds):
        s = await store_rate(url, seconds, concurrency, users)
        store.append(s["per_s"])
        trips.append(s["round_trips_per_check"])
        lim.append((await limits_rate(url, seconds, concurrency, users, strategy))["per_s"])
    ratios = [a / b for a, b in zip(store, lim, strict=True)]
    return {
        "description": (f"{concurrency} concurrent asyncio tasks (uvloop), {users} users, "
                        f"{seconds:g} s per side, {rounds} alternating rounds (medians); one per-user "
                        "rate limit per request on both sides."),
        "store_per_s": statistics.median(store),
        "store_round_trips_per_check": statistics.median(trips),
        "limits_per_s": statistics.median(lim),
        "limits_strategy": strategy,
        "limits_storage": "async+redis://",
        "ratio": statistics.median(ratios),
        "rounds": {"store": [round(x) for x in store], "limits": [round(x) for x in lim]},
    }


def compare(url: str, *, seconds: float = 5.0, concurrency: int = 64, users: int = 1000,
            rounds: int = 2, strategy: str = "MovingWindowRateLimiter") -> dict[str, Any]:
    """Run both sides against the Redis at ``url``; the figures and their ratio."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(_compare(url, seconds, concurrency, users, rounds, strategy))
    return uvloop.run(_compare(url, seconds, concurrency, users, rounds, strategy))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.limits_compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", help="an existing Redis (default: start a throwaway redis-server)")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--strategy", default="MovingWindowRateLimiter",
                   choices=["MovingWindowRateLimiter", "FixedWindowRateLimiter",
                            "SlidingWindowCounterRateLimiter"])
    a = p.parse_args(argv)
    server = None
    url = a.redis_url
    if url is None:
        from extauthz.devtools.stack import free_port

        from .procs import RedisServer

        server = RedisServer(free_port()).start()
        url = server.url
    try:
        r = compare(url, seconds=a.seconds, concurrency=a.concurrency, users=a.users,
                    rounds=a.rounds, strategy=a.strategy)
    finally:
        if server is not None:
            server.stop()
    print(r["description"])
    print(f"Redis store: {r['store_per_s']:,.0f} checks/s "
          f"({r['store_round_trips_per_check']:.3f} round trips per check) {r['rounds']['store']}")
    print(f"limits {r['limits_strategy']}: {r['limits_per_s']:,.0f} hits/s {r['rounds']['limits']}")
    print(f"ratio: {r['ratio']:.2f}x (target >= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
