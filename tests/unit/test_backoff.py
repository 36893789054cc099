"""The one retry backoff (Redis reconnects, failed lease releases): equal jitter, doubling
to a cap, and defined for any number of failures in a row (an outage can last hours)."""

from __future__ import annotations

import pytest

from extauthz.core.backoff import Backoff
from extauthz.engine.release import RETRY_BACKOFF
from extauthz.store.redis.conn import RECONNECT_BACKOFF


@pytest.mark.parametrize(("failures", "low", "high"), [(1, 0.025, 0.05), (2, 0.05, 0.1),
                                                       (3, 0.1, 0.2), (7, 1.0, 2.0), (8, 1.0, 2.0)])
def test_each_wait_doubles_with_jitter_up_to_the_cap(failures: int, low: float, high: float) -> None:
    backoff = Backoff(first=0.05, cap=2.0)
    waits = [backoff.compute(failures) for _ in range(200)]
    assert all(low <= w <= high for w in waits)
    assert max(waits) - min(waits) > 0  # jittered: replicas do not retry in step


@pytest.mark.parametrize("backoff", [RECONNECT_BACKOFF, RETRY_BACKOFF], ids=["reconnect", "release"])
def test_a_long_outage_keeps_the_capped_wait(backoff: Backoff) -> None:
    # redis-py's EqualJitterBackoff computed base * 2**failures: after ~1,030 failed
    # reconnects in a row (some 15 minutes of a Redis outage at one try a second) it raised
    # OverflowError, and the background reconnects stopped.
    for failures in (1_100, 10**6):
        assert backoff.cap / 2 <= backoff.compute(failures) <= backoff.cap
