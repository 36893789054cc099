"""Memory the embedded store holds per distinct key (issue 29, defect 3).

Each kind of keyed state (a monthly quota's count, a token bucket, a lease set) is created for
N new identities through :meth:`MemoryStore.check_now` (hashed identities, as the classifier
makes them), and the memory Python allocated for them is measured with ``tracemalloc``
(everything the store keeps: the state, its key string, the expiry and eviction bookkeeping).
Then 4N more new identities are created with the store bounded at N keys per limiter (when
the store has the bound): the memory it holds must stay where it was. A lease set is kept
while its request is in flight (never evicted then) and freed when the request finishes: the
N first stay in flight, the 4N more finish.

    python -m bench.memory_per_key [--keys 20000]

Before/after: run it on another tree with ``PYTHONPATH=/path/to/other/tree python
bench/memory_per_key.py`` (on a store without the bound, the second figure grows).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import tracemalloc
from collections.abc import Callable

from extauthz.core.clock import ManualClock
from extauthz.store.base import BucketOp, CountOp, LeaseOp, Op
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from testinfra.probes import key_count

KEYS = Keys()
MONTH = 31 * 86400


def identity(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()[:24]


#: kind -> the op a new identity's first request sends
KINDS: dict[str, Callable[[str], Op]] = {
    "quota (monthly)": lambda who: CountOp(KEYS.quota("monthly", who, 1764547200), limit=1000, cost=1,
                                           ttl=MONTH + 3600, reset=MONTH),
    "request_rate": lambda who: BucketOp(KEYS.bucket("user-rate", who), rate=100, burst=500, cost=1),
    "concurrent_requests": lambda who: LeaseOp(KEYS.user_leases("user-conc", who), limit=20, ttl=60),
}


def store_for(bound: int | None) -> MemoryStore:
    if bound is not None and "max_keys" in inspect.signature(MemoryStore).parameters:
        return MemoryStore(ManualClock(), max_keys=bound)  # type: ignore[call-arg,unused-ignore]
    return MemoryStore(ManualClock())


def grow(store: MemoryStore, make: Callable[[str], Op], first: int, n: int, finish: bool = False) -> int:
    """Bytes allocated (and kept) while ``n`` new identities from ``first`` sent one request
    (``finish``: each request then finished, its leases released as the access log does)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(first, first + n):
        op = make(identity(i))
        store.check_now([op], f"r{i}")
        if finish and isinstance(op, LeaseOp):
            store.release_now([op.key], f"r{i}")
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000, help="N: new identities (and the bound)")
    args = parser.parse_args()
    n = args.keys
    tracemalloc.start()
    print(f"N = {n}: bytes per key held; then bytes kept per key of 4N more new identities "
          "(the store bounded at N keys per limiter, when it has the bound; concurrent_requests: "
          "the first N requests still in flight, the 4N more finished)")
    for kind, make in KINDS.items():
        store = store_for(n)
        per_key = grow(store, make, 0, n) / n
        more = grow(store, make, n, 4 * n, finish=True)
        print(f"{kind:<22}{per_key:>8.0f} B/key{more / (4 * n):>10.0f} B/key more "
              f"({key_count(store)} keys held)")


if __name__ == "__main__":
    main()
