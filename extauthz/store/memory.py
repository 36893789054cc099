"""The embedded store: one process, no Redis. The default, for one replica.

Every operation runs synchronously inside one event-loop step, so a check is atomic with
respect to every other check in the process. The rules (refill, admit, sweep, the answers'
numbers, the shed controller) are :mod:`extauthz.store.algorithms`, the same as Redis's.
Leases of one key all have the same TTL (one limiter owns a key), so insertion order is
expiry order and sweeping pops from the front.

Per-user state (buckets, quota counts, lease sets: keys with a ``{u:...}`` tag) is held per
limiter in least recently used order, at most ``max_keys`` keys a limiter (``serve
--memory-max-keys``): a new key past it makes the least recently used one go, counted in
``evictions`` (a lease set only when no request holds a lease in it; a quota count at its
limit only when the oldest few are all spent: a spent count is the state worth keeping).
Without the bound a
flood of made-up API keys grew the store until their keys expired: a month for a monthly
quota. The same order is the expiry order: each check looks at the oldest keys of the
limiters in turn. Other keys (fleet-wide lease sets) have one entry each in a heap keyed by
the time they may next expire. Either way a check looks at no more than ``SWEEP_BATCH``
entries (deleting the expired key, or putting a key that was used since back at its new
expiry): work per check is bounded whatever the number of live keys (a walk over all keys
every 4,096 checks stalled a check 163 ms at 300,000 identities). Expiry changes no answer:
a check reads only live leases and counts of the current window, and a bucket idle past its
TTL refills to its burst anyway; the sweep only frees memory. Eviction does change answers,
which is why it comes only past the bound (docs/limiters.md, "Memory per user").
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.settings import MEMORY_MAX_KEYS
from . import algorithms
from .algorithms import COUNT, LEASES, RULES, SLICES, SLOTS, TOKENS, Rule, TokensOp, refill
from .base import CheckResult, FleetGrantOp, LeaseOp, Op, PeekOp, ShedParams, SliceOp, StoreBase, bucket_ttl
from .keys import Keys

#: due heap entries a check looks at, at most (a check creates at most a few keys, so the
#: sweep keeps up; a backlog after an idle spell drains over the next checks)
SWEEP_BATCH = 32
#: keys looked at, oldest first, for one to forget when a limiter is over its bound: a lease
#: set with live leases is passed over (a request in flight; if all are, the table stays over
#: its bound until requests finish), and so is a spent quota count (if all are, the least
#: recently used of them goes)
EVICT_TRIES = 8
_BUCKET, _LEASES, _SLICES = 0, 1, 2


class MemoryStore(StoreBase):
    name = "memory"
    #: every call completes without waiting: the engine needs no deadline around it.
    immediate = True

    def __init__(self, clock: Clock = SYSTEM_CLOCK, *, sweep_batch: int = SWEEP_BATCH,
                 max_keys: int = MEMORY_MAX_KEYS) -> None:
        self._clock = clock
        #: per-user keys (buckets, quota counts, lease sets) one limiter may hold
        #: (``serve --memory-max-keys``); past it the least recently used goes
        self.max_keys = max_keys
        #: due heap entries a check looks at (0: none; expiry then happens only when a key is
        #: read, as on Redis while its key TTL has not passed)
        self._sweep_batch = sweep_batch
        #: bucket key -> [tokens, last refill time, expires at]
        self._buckets: dict[str, list[float]] = {}
        #: lease key -> {lease id: expires at}, in expiry order
        self._leases: dict[str, dict[str, float]] = {}
        #: ledger key -> {holder: (units, expires at)} (``SliceOp``)
        self._slices: dict[str, dict[str, tuple[int, float]]] = {}
        self._values: dict[str, tuple[str, float | None]] = {}
        self._shed: dict[str, tuple[float, float]] = {}
        #: event log key -> (ring buffer of (wall time, event), expires at)
        self._events: dict[str, tuple[deque[tuple[float, str]], float]] = {}
        #: (time the key may expire, kind, key): one entry per key that is not a user's
        #: (fleet-wide lease sets)
        self._due: list[tuple[float, int, str]] = []
        self._scheduled: tuple[set[str], set[str], set[str]] = (set(), set(), set())
        #: limiter -> its per-user keys (key -> kind), least recently used first: the bound
        #: (:meth:`_hold`) and the expiry order of per-user state (:meth:`_sweep_held`). Not
        #: the heap: an evicted key's heap entry would stay until its due time (a monthly
        #: quota's: the month's end), one more for every key evicted.
        self._held: dict[str, OrderedDict[str, int]] = {}
        #: the limiters whose tables the sweep visits next, in turn
        self._rotation: deque[str] = deque()
        #: limiter -> per-user keys forgotten before they expired (:meth:`_hold`)
        self.evictions: dict[str, int] = {}
        #: each state's reader and writer (algorithms.State): ``check_now`` goes by the rule
        self._read: dict[str, Callable[[Any, float], float]] = {
            TOKENS: self._read_tokens, COUNT: self._read_count, LEASES: self._read_leases, SLOTS: self._read_slots,
            SLICES: self._read_slices}
        self._write: dict[str, Callable[[Any, Rule[Any], float, float, str, str | None], None]] = {
            TOKENS: self._write_tokens, COUNT: self._write_count, LEASES: self._write_leases,
            SLOTS: self._write_slots, SLICES: self._write_slices}
        #: op kind -> its rule and its state's reader and writer (one lookup per op)
        self._kinds = {kind: (rule, self._read[rule.state], self._write[rule.state])
                       for kind, rule in RULES.items()}
        #: due entries looked at, in total (tests bound the work per check with it)
        self.swept = 0

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
            self._unhold(key)
        return leases

    def _grant_leases(self, key: str, now: float) -> dict[str, float]:
        """A fleet key's live leases, every one swept (grant members expire sooner than
        leases taken before them, so the expiry order :meth:`_live_leases` relies on may
        not hold: :meth:`_fleet_grant` restores it)."""
        leases = self._leases.get(key)
        if leases is None:
            return {}
        for member in [m for m, at in leases.items() if not algorithms.lease_live(at, now)]:
            del leases[member]
        if not leases:
            del self._leases[key]
        return leases

    def _grant_others(self, op: FleetGrantOp, now: float) -> int:
        """The live leases of a fleet key that are not members of ``op``'s grant."""
        leases = self._grant_leases(op.key, now)
        return len(leases) - sum(1 for i in range(op.have) if f"{op.grant}:{i}" in leases)

    def _fleet_grant(self, op: FleetGrantOp, top: int, now: float) -> None:
        """Commit a fleet grant of ``top`` slots (the rule:
        :func:`~extauthz.store.algorithms.fleet_grant_top`): renew the members kept (adding
        back those that expired, as Redis's ``ZADD``), add the new ones, drop the rest; the
        key stays in expiry order."""
        leases = self._leases.setdefault(op.key, {})
        at = now + op.ttl
        for i in range(top):
            leases[f"{op.grant}:{i}"] = at
        for i in range(top, op.have):
            leases.pop(f"{op.grant}:{i}", None)
        if leases:
            self._leases[op.key] = dict(sorted(leases.items(), key=lambda kv: kv[1]))
            self._schedule(_LEASES, op.key, next(iter(self._leases[op.key].values())))
        else:
            del self._leases[op.key]

    def _live_slices(self, key: str, now: float) -> dict[str, tuple[int, float]]:
        """A ledger's live slices, the expired ones swept (the key goes with the last)."""
        slices = self._slices.get(key)
        if slices is None:
            return {}
        for holder in [h for h, (_, at) in slices.items() if not algorithms.slice_live(at, now)]:
            del slices[holder]
        if not slices:
            del self._slices[key]
        return slices

    def _schedule(self, kind: int, key: str, at: float, owner: str | None = None) -> None:
        """Keep ``key`` until ``at`` at least: a user's key (of limiter ``owner``, found from
        the key when not given) in its limiter's table (used just now: the most recent), any
        other in the heap."""
        if owner is None:
            owner = Keys.limiter_of(key)
        if owner is not None:
            self._hold(owner, key, kind)
            return
        scheduled = self._scheduled[kind]
        if key not in scheduled:  # an entry is there already: it is moved when it comes due
            scheduled.add(key)
            heapq.heappush(self._due, (at, kind, key))

    def _hold(self, owner: str, key: str, kind: int) -> None:
        """``key`` (a user's, of limiter ``owner``) was used: the most recent of its table.
        A new key past :attr:`max_keys` makes the least recently used one go (counted in
        :attr:`evictions`): a bucket or a quota count at once (its state is forgotten: the
        user's next request starts a full bucket or a count of 0), a lease set only when
        none of its leases is live (a request in flight keeps it). A quota count at or over
        its limit is passed over too (moved to the recent end), for the next of the
        :data:`EVICT_TRIES` oldest: forgetting it is what gives a client its spent quota
        back, and a flood of made-up keys (each asking once) holds none. If every one looked
        at is spent, the least recently used of them goes (the bound holds: a flood of keys
        each spending its own quota can still push a spent count out; counted)."""
        table = self._held.get(owner)
        if table is None:
            table = self._held[owner] = OrderedDict()
            self._rotation.append(owner)
        if key in table:
            table.move_to_end(key)
            return
        table[key] = kind
        if len(table) <= self.max_keys:
            return
        now = self._clock.monotonic()
        spent: str | None = None  # the least recently used spent count passed over
        for _ in range(EVICT_TRIES):
            oldest, what = next(iter(table.items()))
            if what == _LEASES:
                if self._live_leases(oldest, now):  # in use: kept, and the next looked at
                    table.move_to_end(oldest)
                    continue
                if oldest not in table:  # its leases had all expired: gone, not evicted
                    return
                self._leases.pop(oldest, None)
            else:
                state = self._buckets.get(oldest)
                if state is not None and len(state) > 3 and state[0] >= state[3] and state[2] > now:
                    table.move_to_end(oldest)  # a spent quota: the state worth keeping
                    spent = oldest if spent is None else spent
                    continue
                self._buckets.pop(oldest, None)
            self._evict(owner, table, oldest)
            return
        if spent is not None:
            self._buckets.pop(spent, None)
            self._evict(owner, table, spent)

    def _evict(self, owner: str, table: OrderedDict[str, int], key: str) -> None:
        del table[key]
        self.evictions[owner] = self.evictions.get(owner, 0) + 1

    def _unhold(self, key: str) -> None:
        """A user's key whose state is gone (expired, released)."""
        owner = Keys.limiter_of(key)
        if owner is not None and (table := self._held.get(owner)) is not None:
            table.pop(key, None)

    def _touch(self, key: str) -> str | None:
        """A user's key read by a check: the most recent of its table (a refused request
        uses its key as much as an admitted one: a quota spent is not the one forgotten).
        Its limiter (None: not a user's key)."""
        owner = Keys.limiter_of(key)
        if owner is not None and (table := self._held.get(owner)) is not None and key in table:
            table.move_to_end(key)
        return owner

    def _sweep_held(self, now: float, budget: int) -> int:
        """Forget expired per-user keys, the least recently used of each table first, the
        tables in turn: ``budget`` keys looked at at most. A table's oldest key still live
        ends its turn (keys of one limiter mostly expire in the order they were last used;
        one that does not is forgotten later, or evicted)."""
        looked = 0
        rotation = self._rotation
        for _ in range(min(len(rotation), budget)):
            owner = rotation.popleft()
            table = self._held[owner]
            while table and looked < budget:
                key, kind = next(iter(table.items()))
                looked += 1
                if kind == _LEASES:
                    if self._live_leases(key, now):  # forgets the key when none is live
                        break
                    table.pop(key, None)
                    continue
                state = self._buckets.get(key)
                if state is not None and state[2] > now:
                    break
                self._buckets.pop(key, None)
                del table[key]
            if table:
                rotation.append(owner)
            else:
                del self._held[owner]
            if looked >= budget:
                break
        return looked

    def _sweep(self, now: float, budget: int | None = None) -> None:
        """Expire the keys whose heap entries are due, then expired per-user keys: ``budget``
        entries at most (a check's share), or all that are due."""
        due = self._due
        looked = 0
        while due and due[0][0] <= now and (budget is None or looked < budget):
            _, kind, key = heapq.heappop(due)
            looked += 1
            if kind == _BUCKET:
                state = self._buckets.get(key)
                if state is not None and state[2] > now:  # used since: due again later
                    heapq.heappush(due, (state[2], kind, key))
                    continue
                self._buckets.pop(key, None)
            elif kind == _SLICES:
                slices = self._live_slices(key, now)
                if slices:
                    heapq.heappush(due, (min(at for _, at in slices.values()), kind, key))
                    continue
            else:
                leases = self._live_leases(key, now)
                if leases:
                    heapq.heappush(due, (next(iter(leases.values())), kind, key))
                    continue
            self._scheduled[kind].discard(key)
        looked += self._sweep_held(now, (1 << 62) if budget is None else budget - looked)
        self.swept += looked

    def _count(self, key: str, now: float) -> float:
        """A quota window's count. Counts live in the bucket table as ``[count, created,
        expires at, limit]``, so the one sweep forgets them after their window (their keys
        differ from buckets': ``store.keys``); the limit tells eviction a spent count
        (:meth:`_hold`)."""
        state = self._buckets.get(key)
        return 0.0 if state is None or state[2] <= now else state[0]

    # -- contract --------------------------------------------------------------------
    async def check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        return self.check_now(ops, lease_id)

    def check_now(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        now = self._clock.monotonic()
        if self._sweep_batch:
            self._sweep(now, self._sweep_batch)
        # Every op evaluated on its state before the request, then committed iff admitted:
        # the rules and answers of every store (algorithms.RULES).
        kinds = self._kinds
        evaluated = []
        admitted = True
        for op in ops:
            rule, read, write = kinds[type(op)]
            owner = self._touch(op.key)
            value = read(op, now)
            ok = rule.admits(op, value)
            if not ok and op.enforce:
                admitted = False  # shadow ops never block
            evaluated.append((op, rule, write, value, ok, owner))
        results = []
        for op, rule, write, value, ok, owner in evaluated:
            commit = admitted and ok
            if commit:
                write(op, rule, value, now, lease_id, owner)
            results.append(rule.result(op, ok, value, commit))
        return CheckResult(admitted, tuple(results))

    # -- the states ops read and write (algorithms.State), one reader and writer each -------
    def _read_tokens(self, op: TokensOp, now: float) -> float:
        state = self._buckets.get(op.key)
        return op.burst if state is None else refill(state[0], state[1], now, op.rate, op.burst)

    def _write_tokens(self, op: TokensOp, rule: Rule[Any], value: float, now: float, lease_id: str,
                      owner: str | None) -> None:
        state = self._buckets.get(op.key)
        ttl = bucket_ttl(op.rate, op.burst)
        self._buckets[op.key] = [rule.commit(op, value), rule.stamp(now, None if state is None else state[1]),
                                 now + ttl]
        self._schedule(_BUCKET, op.key, now + ttl, owner)

    def _read_count(self, op: Op, now: float) -> float:
        return self._count(op.key, now)

    def _write_count(self, op: Any, rule: Rule[Any], value: float, now: float, lease_id: str,
                     owner: str | None) -> None:
        """The window's count moves by what the commit adds (INCRBY, as ``check.lua``: the
        window's expiry stays); a window gone starts a new count, with the op's ``ttl``
        and ``limit`` (kept for eviction, :meth:`_hold`), unless the op does not create
        one (``Rule.creates``: a give-back, which carries neither)."""
        after = rule.commit(op, value)
        state = self._buckets.get(op.key)
        if state is not None and state[2] > now:
            state[0] += after - value
            if rule.creates:
                state[3] = op.limit
        elif rule.creates:
            self._buckets[op.key] = [after, now, now + op.ttl, op.limit]
            self._schedule(_BUCKET, op.key, now + op.ttl, owner)

    def _read_leases(self, op: Op, now: float) -> float:
        return float(len(self._live_leases(op.key, now)))

    def _write_leases(self, op: LeaseOp, rule: Rule[Any], value: float, now: float, lease_id: str,
                      owner: str | None) -> None:
        leases = self._leases.setdefault(op.key, {})
        leases.pop(lease_id, None)  # a renewed lease moves to the end (expiry order)
        leases[lease_id] = now + op.ttl
        self._schedule(_LEASES, op.key, now + op.ttl, owner)

    def _read_slots(self, op: FleetGrantOp, now: float) -> float:
        return float(self._grant_others(op, now))

    def _write_slots(self, op: FleetGrantOp, rule: Rule[Any], value: float, now: float, lease_id: str,
                     owner: str | None) -> None:
        self._fleet_grant(op, int(rule.commit(op, value)), now)

    def _read_slices(self, op: SliceOp, now: float) -> float:
        return float(sum(units for holder, (units, _) in self._live_slices(op.key, now).items()
                         if holder != op.holder))

    def _write_slices(self, op: SliceOp, rule: Rule[Any], value: float, now: float, lease_id: str,
                      owner: str | None) -> None:
        """The holder's slice set to the rule's size (HSET, as ``check.lua``), or removed at 0."""
        top = int(rule.commit(op, value))
        slices = self._slices.setdefault(op.key, {})
        if top > 0:
            slices[op.holder] = (top, now + op.ttl)
            self._schedule(_SLICES, op.key, now + op.ttl)
        else:
            slices.pop(op.holder, None)
            if not slices:
                del self._slices[op.key]

    def slices(self, key: str) -> dict[str, int]:
        """A ledger's live slices by holder (tests, status)."""
        return {h: units for h, (units, _) in self._live_slices(key, self._clock.monotonic()).items()}

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
                    self._unhold(key)
        return released

    async def inflight(self, keys: Sequence[str]) -> list[int]:
        now = self._clock.monotonic()
        return [len(self._live_leases(k, now)) for k in keys]

    async def peek(self, ops: Sequence[PeekOp]) -> list[float]:
        now = self._clock.monotonic()
        out: list[float] = []
        for op in ops:
            if op.kind == "bucket":
                state = self._buckets.get(op.key)
                out.append(op.burst if state is None else refill(state[0], state[1], now, op.rate, op.burst))
            elif op.kind == "count":
                out.append(self._count(op.key, now))
            else:  # counted without the sweep (check sweeps): nothing changes
                leases = self._leases.get(op.key, {})
                out.append(float(sum(1 for at in leases.values() if algorithms.lease_live(at, now))))
        return out

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

    def held(self) -> dict[str, int]:
        """Per-user keys held per limiter (each at most :attr:`max_keys`, but for lease sets
        with requests in flight), for ``/status``."""
        return {owner: len(table) for owner, table in sorted(self._held.items())}
