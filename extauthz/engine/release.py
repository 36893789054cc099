"""The one release path: every lease this server gives back goes through :class:`Releaser`.

Four paths lead here (the ``path`` label of ``extauthz_lease_releases_total``):

* ``access_log``: Envoy's access log reports a finished request with our lease metadata;
* ``request_id_index``: the entry lacked the metadata (Envoy dropped our answer) and the
  request id found the leases (:class:`~extauthz.server.leases.LeaseIndex`);
* ``cancelled_check``: Envoy reset a Check after we answered (client gone);
* ``abandoned_answer``: a store call the engine stopped waiting for (deadline, or the
  Check cancelled, or the store gave up on it after sending it: a stalled Redis runs it
  when it resumes) landed admitted: what it committed is given back at once.

The embedded store releases within the call (no task). Any other store releases in a
tracked background task: its outcome is counted (``released``, ``none`` when the store
held nothing, e.g. expired, ``error`` when it failed for good; an error is logged,
rate-limited, never left unretrieved in a task), and :meth:`Releaser.drain` waits for the
pending ones on a graceful stop, before the store closes.

A failed call (Redis down, a failover, a timeout) is tried again, each retry counted
(``retried``), after a backoff that doubles from :data:`RETRY_FIRST` to :data:`RETRY_CAP`
seconds (with jitter), until it succeeds or ``retry_for()`` seconds (the policy's longest
lease TTL: by then the store has dropped the lease) have passed since the release was
asked; then it counts as ``error`` and the TTL was the backstop. At most
:data:`MAX_RETRYING` releases wait for a retry at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Final

from ..core.backoff import Backoff
from ..core.errors import StoreError
from ..core.throttle import LogThrottle
from ..store.base import CheckResult, LeaseOp, Op, Store

__all__ = ["OUTCOMES", "PATHS", "Releaser", "releases_status"]

log = logging.getLogger("extauthz.release")

PATHS: Final = ("access_log", "request_id_index", "cancelled_check", "abandoned_answer")
OUTCOMES: Final = ("released", "none", "error", "retried")
#: seconds before the first retry of a failed release; each next one waits twice as long
RETRY_FIRST: Final = 0.05
#: the longest wait between two tries of one release
RETRY_CAP: Final = 2.0
#: most releases waiting to be tried again at once (a long store outage under load would
#: otherwise hold a task per finished request for a whole lease TTL); beyond it a failure
#: is not retried (``error``; the TTL is the backstop)
MAX_RETRYING: Final = 10_000
#: the wait before the n-th retry: RETRY_FIRST, doubling to RETRY_CAP (with jitter)
RETRY_BACKOFF: Final = Backoff(first=RETRY_FIRST, cap=RETRY_CAP)


class Releaser:
    def __init__(self, store: Store, *, timeout: float = 0.05,
                 throttle: LogThrottle | None = None,
                 retry_for: Callable[[], float] | None = None,
                 local: Callable[[Sequence[str], str], tuple[list[str], int]] | None = None) -> None:
        self.store = store
        #: one try of a background release gives up after this long
        self.timeout = timeout
        #: seconds after it was asked that a failing release is still tried again (None: never)
        self.retry_for = retry_for
        self._now: Callable[[Sequence[str], str], int] | None = (
            store.release_now if store.immediate else None)
        #: (path, outcome) -> release calls
        self.counts: dict[tuple[str, str], int] = {(p, o): 0 for p in PATHS for o in OUTCOMES}
        #: leases the store reported given back (a call may free several)
        self.leases_released = 0
        self.pending: set[asyncio.Task[int]] = set()
        #: releases waiting for their next try now
        self.retrying = 0
        self._throttle = throttle or LogThrottle(log)
        #: gives leases held in this replica's batched fleet grants back to them (the engine's
        #: :meth:`~extauthz.limiters.grants.GrantBook.release`): keys left for the store, and
        #: how many were given back locally
        self.local = local

    def count(self, path: str, outcome: str | None = None) -> int:
        """Release calls on ``path`` (with ``outcome``, or all outcomes)."""
        return sum(n for (p, o), n in self.counts.items()
                   if p == path and (outcome is None or o == outcome))

    def release(self, keys: Sequence[str], lease_id: str, path: str) -> asyncio.Task[int] | None:
        """Give back ``lease_id`` in ``keys``: at once on the embedded store (None), else in
        a tracked background task (returned; it never raises, its result is the count)."""
        if path not in PATHS:
            raise ValueError(f"unknown release path {path!r}")
        if not keys or not lease_id:
            return None
        if self.local is not None:
            keys, local = self.local(keys, lease_id)
            if not keys:
                self._done(path, local)
                return None
            self.leases_released += local
        if self._now is not None:
            self._at_once(keys, lease_id, path)
            return None
        task = asyncio.get_running_loop().create_task(self._release(list(keys), lease_id, path))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return task

    def _at_once(self, keys: Sequence[str], lease_id: str, path: str) -> int:
        assert self._now is not None
        try:
            released = self._now(keys, lease_id)
        except Exception as exc:  # counted and logged; the TTL is the backstop
            self._failed(path, exc)
            return 0
        self._done(path, released)
        return released

    async def _release(self, keys: list[str], lease_id: str, path: str) -> int:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + (self.retry_for() if self.retry_for is not None else 0.0)
        failures = 0
        while True:
            try:
                async with asyncio.timeout(self.timeout):
                    released = await self.store.release(keys, lease_id)
            except asyncio.CancelledError as exc:  # drain() gave up on it: counted as failed
                self._failed(path, exc)
                raise
            except Exception as exc:
                failures += 1
                wait = RETRY_BACKOFF.compute(failures)
                # the lease has expired by then (the TTL did it), or too many wait already
                if loop.time() + wait >= give_up or self.retrying >= MAX_RETRYING:
                    self._failed(path, exc)
                    return 0
                self.counts[(path, "retried")] += 1
                self.retrying += 1
                try:
                    await asyncio.sleep(wait)
                except asyncio.CancelledError:  # drain() gave up on it: counted as failed
                    self._failed(path, exc)
                    raise
                finally:
                    self.retrying -= 1
                continue
            self._done(path, released)
            return released

    def _done(self, path: str, released: int) -> None:
        self.leases_released += released
        self.counts[(path, "released" if released else "none")] += 1

    def _failed(self, path: str, exc: BaseException) -> None:
        self.counts[(path, "error")] += 1
        self._throttle.log(logging.WARNING, "a lease release (%s) failed; its TTL will end it: %s",
                           path, f"{type(exc).__name__}: {exc}",
                           fields={"event": "lease_release_failed", "path": path})

    def abandoned(self, ops: Sequence[Op], lease_id: str) -> Callable[[asyncio.Future[CheckResult]], None]:
        """A done callback for a store call nobody waits for any more: when it lands
        admitted, the leases it committed are given back (path ``abandoned_answer``). A
        call that failed after it was sent (its outcome unknown: the error's ``late``) is
        followed to the answer that comes after all."""
        def landed(call: asyncio.Future[CheckResult]) -> None:
            if call.cancelled():
                return
            if (error := call.exception()) is not None:
                if isinstance(error, StoreError) and error.late is not None:
                    error.late.add_done_callback(landed)  # sent, unanswered: its answer may still come
                return  # nothing committed (or nothing known): the failure was counted
            result = call.result()
            if not result.admitted:
                return
            held = [op.key for op, res in zip(ops, result.results, strict=True)
                    if isinstance(op, LeaseOp) and res.allowed]
            if held:
                self.release(held, lease_id, "abandoned_answer")

        return landed

    async def drain(self, within: float = 5.0) -> None:
        """Wait (up to ``within`` seconds) for pending releases, including those started while
        waiting (late abandoned answers); what is left then is cancelled."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while self.pending and (left := end - loop.time()) > 0:
            await asyncio.wait(set(self.pending), timeout=left)
        stuck = set(self.pending)
        for task in stuck:
            task.cancel()
        if stuck:
            await asyncio.wait(stuck)


def releases_status(releaser: Releaser) -> dict[str, object]:
    """The admin ``/status`` view: calls by path and outcome, leases freed, pending."""
    by_path = {p: {o: releaser.counts[(p, o)] for o in OUTCOMES} for p in PATHS}
    return {"by_path": by_path, "leases_released": releaser.leases_released,
            "pending": len(releaser.pending), "retrying": releaser.retrying}
