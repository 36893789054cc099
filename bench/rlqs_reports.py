"""Server CPU per usage-report bucket entry of the rate limit quota stream (issue 33; docs/rlqs.md):
the quota book alone (no gRPC), and the gRPC adapter's protobuf decode and answer build on top.

    .venv/bin/python -m bench.rlqs_reports                          # 20 Envoys x 500 buckets
    .venv/bin/python -m bench.rlqs_reports --envoys 20 --buckets 500 --rounds 5
    .venv/bin/python -m bench.rlqs_reports --ledger memory          # the store ledger settled too
    .venv/bin/python -m bench.rlqs_reports --ledger redis://127.0.0.1:6379/0

Each round, every Envoy (one stream) sends one report holding all its buckets, as Envoy 1.40
does every 5 s. ``shared``: every Envoy holds the same buckets (each divided among all streams:
a report's entry divides among ``--envoys`` streams, the most work per entry); ``distinct``:
each Envoy its own buckets (one holder each). Prints process CPU per bucket entry (the
report decoded, the book, the answers built and encoded) and what ``--envoys x --buckets``
entries every 5 s cost as a share of one core. ``--ledger``: each report's actions settled with
the store's ledger too (``QuotaBook.settle``: one store call per report), on the embedded store
or a Redis URL (this process's CPU only: Redis's own is not counted).

``--memory`` (with a Redis ledger): Redis's ``used_memory`` (``INFO memory``) before the first
report and after the last, the ledger keys the run left (``SCAN`` on the run's own prefix),
their bytes each and the TTL they carry (``PTTL``): the ledger's cost in Redis for
``--envoys x --buckets`` entries. Use a Redis of its own (other clients' writes would count).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from extauthz.core.clock import ManualClock
from extauthz.engine.quota_service import QuotaBook, QuotaLimit, StoreLedger, Usage
from extauthz.proto import rlqs_pb2
from extauthz.server.services import quota_response
from extauthz.store.base import Store
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore


def _report(buckets: int, envoy: int, elapsed: int, shared: bool) -> bytes:
    msg = rlqs_pb2.RateLimitQuotaUsageReports(domain="extauthz")
    for b in range(buckets):
        usage = msg.bucket_quota_usages.add()
        n = b if shared else envoy * buckets + b
        usage.bucket_id.bucket.update({"limiter": "ip-rate", "source_ip": f"10.{n >> 16}.{n >> 8 & 255}.{n & 255}"})
        usage.time_elapsed.seconds = elapsed
        usage.num_requests_allowed = 3 + (b + envoy) % 7
        usage.num_requests_denied = (b * envoy) % 3
    return msg.SerializeToString()


def _store(ledger: str, clock: ManualClock) -> Store | None:
    if ledger == "none":
        return None
    if ledger == "memory":
        return MemoryStore(clock)
    from extauthz.store.redis import RedisStore
    return RedisStore.from_url(ledger, now=clock.monotonic, socket_timeout=5.0)


async def run(envoys: int, buckets: int, rounds: int, shared: bool, ledger: str = "none",
              memory: dict[str, float] | None = None) -> float:
    """CPU seconds per bucket entry over ``rounds`` rounds (after one subscribing round);
    ``memory`` (a Redis ledger): filled with :func:`redis_memory`'s figures."""
    clock = ManualClock()
    limits = {"ip-rate": QuotaLimit(100, 200)}
    store = _store(ledger, clock)
    prefix = f"bench{time.time_ns()}"
    book = QuotaBook(lambda: limits, clock=clock,
                     ledger=None if store is None else StoreLedger(store, Keys(prefix)))
    used_before = _used_memory(ledger) if memory is not None else 0
    if store is not None:  # a store a replica used before: no new store's first two intervals frozen
        await store.check(StoreLedger(store, Keys(prefix), replica="earlier").marker_ops(), "")
    streams = [book.open(f"envoy-{e}") for e in range(envoys)]
    first = [_report(buckets, e, 0, shared) for e in range(envoys)]
    later = [_report(buckets, e, 5, shared) for e in range(envoys)]

    async def one(wire: bytes, e: int) -> None:
        msg = rlqs_pb2.RateLimitQuotaUsageReports.FromString(wire)
        usages = [Usage(dict(u.bucket_id.bucket), u.time_elapsed.seconds + u.time_elapsed.nanos / 1e9,
                        u.num_requests_allowed, u.num_requests_denied) for u in msg.bucket_quota_usages]
        out = book.report(streams[e], msg.domain, usages)
        if book.ledger is not None:
            out = await book.settle(out)
        for actions in out.values():
            quota_response(actions).SerializeToString()

    try:
        for e in range(envoys):
            await one(first[e], e)
        cpu = 0.0
        for _ in range(rounds):
            clock.advance(5)
            start = time.process_time()
            for e in range(envoys):
                await one(later[e], e)
            cpu += time.process_time() - start
        if memory is not None:
            memory.update(redis_memory(ledger, prefix, used_before))
    finally:
        if store is not None:
            await store.close()
    return cpu / (rounds * envoys * buckets)


def _used_memory(url: str) -> int:
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as client:
        return int(client.info("memory")["used_memory"])


def redis_memory(url: str, prefix: str, used_before: int) -> dict[str, float]:
    """The run's ledger keys in Redis: how many (``SCAN`` on ``prefix``), ``used_memory``'s growth
    since ``used_before`` per key and in all, ``MEMORY USAGE`` of one key, and the longest and
    shortest ``PTTL`` left (every key must carry one)."""
    import redis

    with redis.Redis.from_url(url, socket_timeout=5) as client:
        used = int(client.info("memory")["used_memory"])
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.pttl(key)
        ttls = [int(t) for t in pipe.execute()]
        sample = int(client.memory_usage(keys[0], samples=0) or 0) if keys else 0
    return {"keys": len(keys), "used_bytes": used - used_before,
            "bytes_per_key": (used - used_before) / len(keys) if keys else 0.0,
            "memory_usage_one_key": sample,
            "pttl_min_s": min(ttls) / 1000 if ttls else -1, "pttl_max_s": max(ttls) / 1000 if ttls else -1,
            "without_ttl": sum(1 for t in ttls if t < 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envoys", type=int, default=20)
    parser.add_argument("--buckets", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ledger", default="none", help="none, memory, or a redis:// URL")
    parser.add_argument("--memory", action="store_true",
                        help="with a redis:// ledger: Redis memory and TTL of the ledger keys the run left")
    parser.add_argument("--only", choices=("distinct", "shared"), default=None, help="one of the two cases")
    args = parser.parse_args()
    if args.memory and not args.ledger.startswith(("redis://", "rediss://")):
        parser.error("--memory needs --ledger redis://...")
    entries = args.envoys * args.buckets
    print(f"{args.envoys} Envoys x {args.buckets} buckets = {entries} entries per 5 s report round"
          f" (ledger: {args.ledger})")
    for label, shared in (("distinct", False), ("shared", True)):
        if args.only not in (None, label):
            continue
        memory: dict[str, float] | None = {} if args.memory else None
        per = asyncio.run(run(args.envoys, args.buckets, args.rounds, shared, args.ledger, memory))
        print(f"{label:8} {per * 1e6:7.1f} us CPU per entry; {entries} entries / 5 s = "
              f"{per * entries / 5 * 100:.1f}% of one core")
        if memory is not None:
            held = args.buckets * (1 if shared else args.envoys)
            print(f"{'':8} Redis: {memory['keys']:.0f} ledger keys for {held} buckets "
                  f"({args.envoys if shared else 1} holder(s) each), used_memory +{memory['used_bytes']:,.0f} bytes "
                  f"({memory['bytes_per_key']:.0f} per key, {memory['used_bytes'] / held:.0f} per bucket; "
                  f"MEMORY USAGE of one key {memory['memory_usage_one_key']:.0f}); PTTL "
                  f"{memory['pttl_min_s']:.1f}-{memory['pttl_max_s']:.1f} s, {memory['without_ttl']:.0f} without")


if __name__ == "__main__":
    main()
