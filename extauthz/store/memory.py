"""The embedded store: one process, no Redis. The default, for one replica.

Every operation runs synchronously inside one event-loop step, so a check is atomic with
respect to every other check in the process. The rules (refill, admit, sweep, the answers'
numbers, the shed controller) are :mod:`extauthz.store.algorithms`, the same as Redis's.
Leases of one key all have the same TTL (one limiter owns a key), so insertion order is
expiry order and sweeping pops from the front.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..clock import SYSTEM_CLOCK, Clock
from . import algorithms
from .algorithms import admits, bucket_result, count_admits, count_result, lease_admits, lease_result, refill, take
from .base import BucketOp, CheckResult, CountOp, Op, ShedParams

_SWEEP_EVERY = 4096


class MemoryStore:
    name = "memory"
    #: every call completes without waiting: the engine needs no deadline around it.
    immediate = True

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        #: bucket key -> [tokens, last refill time, expires at]
        self._buckets: dict[str, list[float]] = {}
        #: lease key -> {lease id: expires at}, in expiry order
        self._leases: dict[str, dict[str, float]] = {}
        self._values: dict[str, tuple[str, float | None]] = {}
        self._shed: dict[str, tuple[float, float]] = {}
        #: event log key -> (ring buffer of (wall time, event), expires at)
        self._events: dict[str, tuple[deque[tuple[float, str]], float]] = {}
        self._ops = 0

    # -- helpers ---------------------------------------------------------------------
    def _live_leases(self, key: str, now: float) -> dict[str, float]:
        leases = self._leases.get(key)
        if leases is None:
            return {}
        while leases:
            first = next(iter(leases))
            if algorithms.lease_live(leases[first], now):
                break
            del leases[first]
        if not leases:
            del self._leases[key]
        return leases

    def _sweep(self, now: float) -> None:
        for key in [k for k, v in self._buckets.items() if v[2] <= now]:
            del self._buckets[key]
        for key in list(self._leases):
            self._live_leases(key, now)

    def _count(self, key: str, now: float) -> float:
        """A quota window's count. Counts live in the bucket table as ``[count, created,
        expires at]``, so the one sweep forgets them after their window (their keys differ
        from buckets': ``store.keys``)."""
        state = self._buckets.get(key)
        return 0.0 if state is None or state[2] <= now else state[0]

    # -- contract --------------------------------------------------------------------
    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        return self.check_now(ops, lease_id)

    def check_now(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        now = self._clock.monotonic()
        self._ops += 1
        if self._ops % _SWEEP_EVERY == 0:
            self._sweep(now)
        # State before the request, then the same rules and answers as every store.
        values: list[float] = []
        allowed: list[bool] = []
        admitted = True
        for op in ops:
            if isinstance(op, BucketOp):
                state = self._buckets.get(op.key)
                value = op.burst if state is None else refill(state[0], state[1], now, op.rate, op.burst)
                ok = admits(value, op.cost)
            elif isinstance(op, CountOp):
                value = self._count(op.key, now)
                ok = count_admits(int(value), op.cost, op.limit)
            else:
                value = float(len(self._live_leases(op.key, now)))
                ok = lease_admits(int(value), op.limit)
            values.append(value)
            allowed.append(ok)
            if not ok and op.enforce:
                admitted = False  # shadow ops never block
        results = []
        for op, ok, value in zip(ops, allowed, values, strict=True):
            commit = admitted and ok
            if isinstance(op, BucketOp):
                if commit:
                    self._buckets[op.key] = [take(value, op.cost), now, now + op.ttl]
                results.append(bucket_result(op, ok, value, commit))
            elif isinstance(op, CountOp):
                if commit:
                    state = self._buckets.get(op.key)
                    if state is not None and state[2] > now:
                        state[0] += op.cost  # the window's expiry stays
                    else:
                        self._buckets[op.key] = [float(op.cost), now, now + op.ttl]
                results.append(count_result(op, ok, int(value), commit))
            else:
                if commit:
                    leases = self._leases.setdefault(op.key, {})
                    leases.pop(lease_id, None)  # a renewed lease moves to the end (expiry order)
                    leases[lease_id] = now + op.ttl
                results.append(lease_result(op, ok, int(value), commit))
        return CheckResult(admitted, tuple(results))

    async def release(self, keys: Sequence[str], lease_id: str) -> int:
        return self.release_now(keys, lease_id)

    def release_now(self, keys: Sequence[str], lease_id: str) -> int:
        """:meth:`release` within the call (the access-log path needs no task for it)."""
        released = 0
        for key in keys:
            leases = self._leases.get(key)
            if leases is not None and leases.pop(lease_id, None) is not None:
                released += 1
                if not leases:
                    del self._leases[key]
        return released

    async def inflight(self, keys: Sequence[str]) -> list[int]:
        now = self._clock.monotonic()
        return [len(self._live_leases(k, now)) for k in keys]

    async def get_value(self, key: str) -> str | None:
        item = self._values.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and expires <= self._clock.monotonic():
            del self._values[key]
            return None
        return value

    async def set_value(self, key: str, value: str | None, ttl: float | None = None) -> None:
        if value is None:
            self._values.pop(key, None)
        else:
            self._values[key] = (value, None if ttl is None else self._clock.monotonic() + ttl)

    async def swap_value(self, key: str, expected: str | None, value: str | None,
                         ttl: float | None = None) -> bool:
        if await self.get_value(key) != expected:
            return False
        await self.set_value(key, value, ttl)
        return True

    async def shed_update(self, key: str, utilization: float, params: ShedParams) -> float:
        now = self._clock.monotonic()
        level, last = self._shed.get(key, (None, None))
        new = algorithms.shed_advance(level, last, now, utilization, params)
        self._shed[key] = (new, now)
        return new

    async def append_events(self, key: str, events: Sequence[str], maxlen: int, ttl: float) -> None:
        now = self._clock.monotonic()
        item = self._events.get(key)
        ring = item[0] if item is not None and item[1] > now else None
        if ring is None or ring.maxlen != maxlen:
            ring = deque(ring or (), maxlen=max(1, maxlen))
        wall = self._clock.wall()
        ring.extend((wall, e) for e in events)
        self._events[key] = (ring, now + ttl)

    async def read_events(self, key: str, since: float) -> list[str]:
        item = self._events.get(key)
        if item is None:
            return []
        if item[1] <= self._clock.monotonic():
            del self._events[key]
            return []
        return [e for t, e in item[0] if t >= since]

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    # -- introspection for tests and status -------------------------------------------
    def tokens(self, key: str) -> float | None:
        state = self._buckets.get(key)
        return None if state is None else state[0]

    def live_leases(self) -> dict[str, int]:
        """Live leases per lease key (expired ones swept first): the embedded store's
        in-flight picture, shown on the admin ``/status``."""
        now = self._clock.monotonic()
        return {key: n for key in list(self._leases) if (n := len(self._live_leases(key, now)))}

    def key_count(self) -> int:
        return (len(self._buckets) + len(self._leases) + len(self._values) + len(self._shed)
                + len(self._events))
