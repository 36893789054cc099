"""The one retry backoff: Redis reconnects (:mod:`extauthz.store.redis.conn`) and failed
lease releases (:mod:`extauthz.engine.release`) wait by it."""

from __future__ import annotations

import random

__all__ = ["Backoff"]

#: doublings past which every wait is the cap (2**64 times any first wait is past any cap)
_MAX_DOUBLINGS = 64


class Backoff:
    """Equal-jitter exponential backoff: after ``n`` failures in a row (n >= 1) the wait is
    between half and all of ``min(cap, first * 2**(n - 1))`` seconds, so replicas that failed
    together do not retry in step. Defined for any ``n`` (redis-py's ``EqualJitterBackoff``
    raises OverflowError past about 1,030 failures: a long outage)."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap

    def compute(self, failures: int) -> float:
        doublings = min(max(failures - 1, 0), _MAX_DOUBLINGS)
        ceiling = min(self.cap, self.first * 2.0 ** doublings)
        return ceiling * (0.5 + random.random() / 2)
