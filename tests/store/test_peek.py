"""``Store.peek`` (``extauthz inspect``): each limiter kind's state as ``check`` reads it,
on every store (memory, real Redis, Cluster, Sentinel) on one injected clock; a peek changes
nothing (the state after a peek and a check equals the check's alone)."""

from __future__ import annotations

import pytest

from extauthz.store.base import BucketOp, CountOp, LeaseOp, PeekOp
from extauthz.store.keys import Keys

from .conftest import StoreCase

pytestmark = pytest.mark.asyncio

K = Keys("peek")
ID = "0123456789abcdef01234567"


async def test_peek_reads_tokens_counts_and_leases_as_check_does(store_case: StoreCase) -> None:
    store, clock = store_case.store, store_case.clock
    bucket, count, leases = K.bucket("rate", ID), K.quota("q", ID, 0), K.user_leases("cc", ID)
    peeks = [PeekOp("bucket", bucket, 2.0, 10.0), PeekOp("count", count), PeekOp("leases", leases)]
    assert await store.peek(peeks) == [10.0, 0.0, 0.0]  # nothing stored: a full bucket

    for i in range(3):
        result = await store.check([BucketOp(bucket, 2.0, 10.0, 2.0), CountOp(count, 100, 1, 60, 60.0),
                                    LeaseOp(leases, 5, 30.0)], f"lease-{i}")
        assert result.admitted
    assert await store.peek(peeks) == [4.0, 3.0, 3.0]
    assert await store.peek(peeks) == [4.0, 3.0, 3.0]  # peeking twice changes nothing

    clock.advance(1.5)  # refilled to now from the stored state: 4 + 1.5 * 2
    assert await store.peek(peeks) == [7.0, 3.0, 3.0]
    # the next check sees what the peek said: 7 tokens before it, 5 after
    result = await store.check([BucketOp(bucket, 2.0, 10.0, 2.0)], "x")
    assert result.results[0].remaining == 5.0
    await store.release([leases], "lease-0")
    clock.advance(30.0)  # the other two leases expired: not counted (and not swept by the peek)
    assert (await store.peek(peeks))[1:] == [3.0, 0.0]


async def test_peek_survives_script_flush(store_case: StoreCase) -> None:
    """SCRIPT FLUSH on every master (a Redis restart, a failover): the peek loads its script
    again (NOSCRIPT) and answers."""
    if store_case.topology is None:
        pytest.skip("the embedded store runs no script")
    from .conftest import masters

    store = store_case.store
    peek = [PeekOp("bucket", K.bucket("rate", ID), 1.0, 4.0)]
    assert await store.peek(peek) == [4.0]
    for master in masters(store_case.topology):
        master.script_flush()
    assert await store.peek(peek) == [4.0]
