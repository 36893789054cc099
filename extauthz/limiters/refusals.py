"""Floods cost nothing: a user refused by a request-rate limiter is refused locally, with
no store call, until its bucket would hold enough tokens again.

The store's refusal says everything needed: the tokens in the bucket at that moment
(``remaining``), and therefore when ``cost`` tokens will be back (``retry_after``) and when
the bucket is full (``reset``). A refused request takes nothing, so until then the bucket
only refills: ``elapsed`` seconds later the store would answer ``remaining + elapsed*rate``,
``retry_after - elapsed`` and ``reset - elapsed``, which is what :meth:`RefusalCache.refusal`
answers (same verdict, so the same 429, ``Retry-After`` and ``RateLimit`` headers).

* One replica: exact, except that the window is anchored when the store's answer arrives,
  so it can end up to that answer's latency (one round trip) after the bucket refilled.
* Several replicas sharing the bucket: another replica may take tokens meanwhile, so the
  real bucket holds at most what the cached refusal assumes. The cached refusal can only
  end early (the store is asked again, and refuses again if the others took the tokens);
  it never admits anything, so it never lets more than the limit through.
* Batched grants (``consistency: batched``): other replicas give unspent grants back, so
  the bucket may refill faster than ``rate``; a refusal is remembered at most one
  ``sync_interval`` (``max_window``), which keeps it inside the batched bound.
* Only enforced refusals are remembered and only enforced limiters answer from the cache:
  a shadow limiter's refusals never block. A refusal is only used for the numbers (rate,
  burst, cost) it was given for; a policy reload starts a new cache.
* Bounded: at most :data:`MAX_ENTRIES` users (the oldest refusal is dropped first), each
  entry gone once its window has passed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.verdict import Outcome, Verdict
from ..store.algorithms import TOKEN_EPSILON

__all__ = ["MAX_ENTRIES", "RefusalCache"]

#: Refused users remembered per limiter (a flood is a few keys; a botnet of many keys
#: evicts its own oldest entries, which only means more store calls).
MAX_ENTRIES: Final = 10_000
#: A remembered refusal ends this much early (seconds), or earlier by the time
#: ``TOKEN_EPSILON`` tokens take to flow in (the store admits a hair early, see
#: store/algorithms.py): times that close ask the store, whose own rule decides (ending
#: early is always safe).
EARLY: Final = 1e-6


@dataclass(frozen=True, slots=True)
class _Refusal:
    at: float
    until: float
    numbers: tuple[float, float, float]
    verdict: Verdict


class RefusalCache:
    """Enforced refusals by bucket key, until the bucket would admit again."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, max_entries: int = MAX_ENTRIES,
                 max_window: float | None = None) -> None:
        self._clock = clock
        self.max_entries = max_entries
        #: a refusal is remembered at most this long (batched grants: ``sync_interval``,
        #: since tokens given back by other replicas can refill the bucket sooner)
        self.max_window = max_window
        self._entries: dict[str, _Refusal] = {}
        #: requests answered from the cache (no store call)
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, key: str, verdict: Verdict, rate: float, burst: float, cost: float) -> None:
        """The store refused ``key`` (an enforced denial with its ``retry_after``)."""
        if (self.max_entries <= 0 or verdict.outcome is not Outcome.DENIED
                or verdict.retry_after is None or verdict.retry_after <= 0):
            return
        now = self._clock.monotonic()
        entries = self._entries
        entries.pop(key, None)
        if len(entries) >= self.max_entries:
            for old in [k for k, e in entries.items() if e.until <= now]:
                del entries[old]
            while len(entries) >= self.max_entries:
                del entries[next(iter(entries))]  # the oldest refusal
        until = now + verdict.retry_after - max(EARLY, TOKEN_EPSILON / rate)
        if self.max_window is not None:
            until = min(until, now + self.max_window)
        entries[key] = _Refusal(now, until, (rate, burst, cost), verdict)

    def refusal(self, key: str, rate: float, burst: float, cost: float) -> Verdict | None:
        """The store's answer for ``key`` now, if it is a remembered refusal still running."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock.monotonic()
        if now >= entry.until or entry.numbers != (rate, burst, cost):
            del self._entries[key]
            return None
        self.hits += 1
        elapsed = now - entry.at
        v = entry.verdict
        return dataclasses.replace(
            v,
            remaining=None if v.remaining is None else v.remaining + elapsed * rate,
            retry_after=v.retry_after - elapsed if v.retry_after is not None else None,
            reset=None if v.reset is None else v.reset - elapsed,
        )
