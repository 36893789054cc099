"""The embedded store's expiry on an injected clock: idle buckets and expired leases are
forgotten, a key used again is kept until its new expiry, and no check does more than a
bounded share of the work, however many identities are live or expire at once (a walk over
every key inside one check stalled it 163 ms at 300,000 identities)."""

from __future__ import annotations

from extauthz.core.clock import ManualClock
from extauthz.store import memory
from extauthz.store.base import BucketOp, LeaseOp
from extauthz.store.keys import Keys
from extauthz.store.memory import MemoryStore
from testinfra.probes import key_count

K = Keys("t")
N = 10_000  # identities
CHECKS = 5_000  # more than N * 2 / SWEEP_BATCH, and past the old sweep's 4,096th check


def rate_op(who: str) -> BucketOp:
    return BucketOp(K.bucket("rate", who), rate=10, burst=20, cost=1)  # ttl 4 s


def lease_op(who: str) -> LeaseOp:
    return LeaseOp(K.user_leases("conc", who), limit=2, ttl=30)


def fill(store: MemoryStore, n: int = N) -> None:
    for i in range(n):
        assert store.check_now([rate_op(f"u{i}"), lease_op(f"u{i}")], f"r{i}").admitted


def test_expired_identities_go_a_bounded_number_per_check() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    fill(store)
    assert key_count(store) == 2 * N
    clock.advance(31)  # past every bucket's idle time and every lease's TTL
    removed = []
    for j in range(CHECKS):
        before = key_count(store)
        store.check_now([rate_op("hot")], f"h{j}")
        removed.append(before + (1 if j == 0 else 0) - key_count(store))
    assert max(removed) <= memory.SWEEP_BATCH, max(removed)  # was all 20,000 in one check
    assert key_count(store) == 1  # every expired key went; the hot bucket stays
    assert store.live_leases() == {}


def test_the_work_per_check_is_bounded_with_many_live_identities() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    fill(store)
    looked = []
    for j in range(CHECKS):
        clock.advance(0.001)  # 5 s in all: the buckets (4 s) come due, the leases (30 s) do not
        before = store.swept
        store.check_now([rate_op(f"new{j}")], f"n{j}")
        looked.append(store.swept - before)
    assert max(looked) <= memory.SWEEP_BATCH
    assert sum(looked) >= N  # the due buckets were looked at (and forgotten)
    assert len(store.live_leases()) == N


def test_a_key_used_again_is_kept_until_its_new_expiry() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    key = rate_op("alice").key
    store.check_now([rate_op("alice")], "a1")  # expires at +4 s
    clock.advance(3)
    store.check_now([rate_op("alice")], "a2")  # now at +7 s
    clock.advance(2)  # +5: the first expiry is due, the bucket is not
    store.check_now([rate_op("bob")], "b1")
    assert store.tokens(key) == 19.0  # kept, exactly as the second check left it (refilled, took 1)
    clock.advance(2)  # +7
    store.check_now([rate_op("bob")], "b2")
    assert store.tokens(key) is None  # idle past its TTL: forgotten


def test_a_lease_key_is_swept_once_its_last_lease_expires() -> None:
    clock = ManualClock()
    store = MemoryStore(clock)
    op = lease_op("alice")
    store.check_now([op], "l1")
    clock.advance(20)
    store.check_now([op], "l2")  # expires 20 s after the first
    clock.advance(15)  # the first lease expired, the second is live
    store.check_now([rate_op("bob")], "b1")
    assert store.live_leases() == {op.key: 1}
    assert op.key in store._leases
    clock.advance(20)
    store.check_now([rate_op("bob")], "b2")
    assert op.key not in store._leases
    assert key_count(store) == 1  # bob's bucket
