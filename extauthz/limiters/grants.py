"""Batched grants (``consistency: batched``): a check that needs no store call.

A replica takes tokens from the shared bucket in grants (:class:`~extauthz.store.base.GrantOp`,
``batch`` tokens at a time) and spends them locally; it asks the store again only when its
grant for a key runs out. The rule itself (what a grant takes, what a return gives back) is
:mod:`extauthz.store.algorithms`, the same for both stores (``lua/check.lua`` mirrors it).

The guarantee, across any number of replicas: a grant is taken from the shared bucket
atomically, by the bucket's own admit rule, before any of it is spent, and a replica admits
a request only from tokens it was granted; so the bucket never yields more than it would to
the exact limiter over the same window, and no more is admitted. The cost: a replica may
refuse while others hold unspent grant, at most ``batch x (replicas - 1)`` tokens early,
and only until those grants go back:

* unspent grant goes back (:class:`~extauthz.store.base.ReturnOp`) within ``sync_interval``
  of being taken: a timer every half interval returns each grant at least half an interval
  old, in the existing batched script call (returns ride with the next check, as lease
  releases do);
* a token bucket's grant that a request spent from in the last half interval is
  **renewed** instead: one :class:`~extauthz.store.base.GrantOp` of cost 0 gives the unspent
  grant back and takes the next one in the same atomic step (the bucket's own grant rule, so
  the guarantee and the bound are the same), off the request path: a key in use keeps
  answering from a grant instead of asking the store on a request once per interval, and
  one interval after its traffic stops no replica holds any of it;
* a key whose replica holds none of its grant for ``sync_interval`` is forgotten;
* grants that land together (several requests of one key asked in one loop turn) are kept
  up to one grant (``want``); the rest goes back at once, so no replica holds more than
  ``batch`` (or the cost of one request, if larger).

The same table serves every kind that takes grants: ``request_rate`` (tokens of a bucket,
:class:`~extauthz.store.base.GrantOp`) and ``quota`` (units of a window's count,
:class:`~extauthz.store.base.QuotaGrantOp`); the limiter names the numbers a grant is
taken with and the op that gives it back (``give_back``).

A policy reload builds new limiters with new tables; the old tables give back what they
hold at once (:meth:`GrantBook.adopt`), and a grant taken with other numbers (a plan or an
override changed) is never spent for the new ones: it goes back. Unspent grant lost to a
crash only refuses early (the shared bucket refills it, the quota window ends), never
admits more. The counters (:meth:`GrantTable.status`) are the table's own: status and
metrics read them.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.verdict import Verdict
from ..store.algorithms import admits, given_back, take
from ..store.base import CheckResult, GrantOp, Op, OpResult, ReturnOp, Store
from .base import GrantHolder, Limiter

__all__ = ["EARLY_BUCKETS", "GRANT_METRICS", "GrantBook", "GrantTable", "Numbers", "Synced", "bucket_renew",
           "default_batch"]

#: a check's limiter slots, as the engine keeps them: (limiter, enforce, its local verdict,
#: the index of its store op or -1)
Slot = tuple[Limiter, bool, Verdict | None, int]

#: the limiter's numbers a grant was taken with (a bucket: ``(rate, burst)``; a quota:
#: ``(limit,)``): a grant is spent only for the same numbers, and goes back with them
Numbers = tuple[float, ...]
#: the op that gives ``amount`` of a key's grant back, from the numbers it was taken with
GiveBack = Callable[[str, Numbers, float], Op]


def bucket_return(key: str, numbers: Numbers, amount: float) -> Op:
    """A token bucket's give-back (``request_rate``)."""
    rate, burst = numbers
    return ReturnOp(key, rate, burst, amount)


#: the op that gives ``held`` of a key's grant back and takes the next grant of up to
#: ``want`` in one atomic step (a grant a request spent from in the last half interval)
Renew = Callable[[str, Numbers, float, float], GrantOp]


def bucket_renew(key: str, numbers: Numbers, held: float, want: float) -> GrantOp:
    """A token bucket's renewal (``request_rate``): a grant of cost 0, so always admitted,
    that gives ``held`` back and takes up to ``want`` from the pool (the bucket's own rule:
    :func:`~extauthz.store.algorithms.grant_pool`, :func:`~extauthz.store.algorithms.grant_size`)."""
    rate, burst = numbers
    return GrantOp(key, rate, burst, 0.0, want, False, held)

#: the early-refusal histogram's bucket bounds (tokens, quota units or fleet slots)
EARLY_BUCKETS: Final = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)

#: timer ticks per sync_interval: a grant goes back at the first tick at least half an
#: interval after it was taken, so within one interval
TICKS: Final = 2
#: ops per store call when a table sends many at once (a sync turn, a settle, a retire):
#: one call each, sent one after another. A sync turn of a thousand keys as a thousand
#: single-op calls held the event loop for tens of ms, and the checks waiting on the store
#: then missed their deadline (docs/benchmarks.md, the (rhb) fail-opens of 2026-11-25). Not
#: more: a call rides in the merged script call of the checks of its loop turn, and they
#: wait for its ops to run in Redis (64 gave (rhb) 83 timeout fail-opens where 16 gave 34,
#: one run each, 2026-11-26).
SEND_CHUNK: Final = 16


def default_batch(rate: float, sync_interval: float, cost: float) -> float:
    """The documented default ``batch``: the tokens one ``sync_interval`` refills, at
    least 1 and at least one request's ``cost``."""
    return max(1.0, rate * sync_interval, cost)


@dataclass(slots=True)
class _Held:
    #: unspent granted tokens held here
    tokens: float
    #: the shared bucket's tokens at the last store answer (for ``remaining``)
    shared: float
    #: when the oldest grant not yet given back was taken (clock.monotonic)
    taken_at: float
    #: when it last came to hold none (forgotten ``sync_interval`` later)
    empty_since: float
    #: the limiter's numbers the grant was taken with (a return carries them)
    numbers: Numbers
    #: what one grant takes for the key (a renewal asks as much)
    want: float = 0.0
    #: when a request last spent from it (clock.monotonic): a grant due within half an
    #: interval of that is renewed, not only given back
    spent_at: float = float("-inf")


class Synced:
    """The background life every grant table shares: a timer running :meth:`sync` every
    ``period`` seconds while :meth:`busy` (armed only with a store), and the tracked tasks
    of the store calls it sends (:meth:`drain` waits for them, :meth:`close` stops
    everything)."""

    period: float

    def __init__(self, store: Store | None = None) -> None:
        #: where grants are asked and given back (the engine's store, given when the limiters
        #: are built: :func:`~extauthz.limiters.build_limiters`); None: nowhere (a limiter
        #: built without a store, e.g. to check names)
        self.store = store
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        #: counters (status(), /metrics): requests answered from a grant (each a store call
        #: saved), grants taken, grants given back because ``sync_interval`` passed
        #: (``expired``), the amount given back (any reason), give-backs that failed (their
        #: amount only refuses early: never admitted), and the requests admitted past the
        #: exact limiter's count as far as the store can tell (must stay 0: fleet slots in
        #: use restored past ``limit``, :func:`~extauthz.store.algorithms.fleet_grant_over`)
        self.local = 0
        self.grants = 0
        self.expired = 0
        self.returned = 0.0
        self.return_errors = 0
        self.overadmitted = 0
        #: granted tokens dropped unspent, held past ``spend_within`` (a stall)
        self.dropped = 0.0
        #: the early-refusal histogram (:meth:`unspent_at_limit`): observations per bucket of
        #: :data:`EARLY_BUCKETS` (+Inf last; not cumulative) and their sum
        self.early = [0] * (len(EARLY_BUCKETS) + 1)
        self.early_sum = 0.0

    def status(self) -> dict[str, float]:
        """The table's counters and what it holds now (/status, /metrics)."""
        return {"keys": self.keys_held(), "held": self.total(), "grants_taken": self.grants,
                "grants_expired": self.expired, "returned": self.returned,
                "return_errors": self.return_errors, "store_calls_saved": self.local,
                "overadmission": self.overadmitted, "dropped": self.dropped,
                "early_refusals": sum(self.early), "early_refusal_amount": self.early_sum}

    def unspent_at_limit(self, amount: float) -> None:
        """``amount`` of this replica's grant goes back unspent, and the store's answer
        says the shared state without it could not pay one request more: while it stood
        here, requests asking elsewhere were refused early, by at most this much (the
        early-refusal histogram, ``extauthz_early_refusal``)."""
        if amount > 0.0:
            self.early[bisect_left(EARLY_BUCKETS, amount)] += 1
            self.early_sum += amount

    def early_refusals(self) -> tuple[list[tuple[str, float]], float]:
        """The early-refusal histogram as /metrics shows it: cumulative ``(le, count)``
        buckets (+Inf last) and the sum."""
        total, buckets = 0, []
        for bound, n in zip((*map(str, EARLY_BUCKETS), "+Inf"), self.early, strict=True):
            total += n
            buckets.append((bound, float(total)))
        return buckets, self.early_sum

    def release(self, key: str, lease_id: str) -> bool:
        """A finished request's lease given back to a local grant (True), if it held one
        here (only fleet slots hold leases: :class:`~extauthz.limiters.fleet.FleetSlots`)."""
        return False

    @property
    def done(self) -> bool:
        """Holding nothing, with nothing to do any more (a retired table can be forgotten)."""
        return not self.busy()

    def keys_held(self) -> int:
        raise NotImplementedError

    def total(self) -> float:
        raise NotImplementedError

    async def sync(self) -> int:
        raise NotImplementedError

    def busy(self) -> bool:
        """Whether the timer still has something to do."""
        raise NotImplementedError

    def _take_all(self) -> Sequence[Any]:
        """Stop the timer and take out what goes back to the store now (its ops)."""
        raise NotImplementedError

    async def _send(self, ops: Sequence[Any]) -> list[Any]:
        """Send ``ops`` (of :meth:`_take_all` or :meth:`sync`) in one store call: one result
        per op (errors counted, never raised)."""
        raise NotImplementedError

    async def _send_all(self, ops: Sequence[Any]) -> list[Any]:
        """Send ``ops`` in calls of :data:`SEND_CHUNK` ops, one after another."""
        out: list[Any] = []
        for start in range(0, len(ops), SEND_CHUNK):
            out.extend(await self._send(ops[start:start + SEND_CHUNK]))
        return out

    #: whether the timer runs on after :meth:`retire` (fleet slots: those in use stay
    #: renewed until their leases go)
    renews_after_retire = False

    async def settle(self) -> None:
        """Give back everything held now and stop (a graceful stop: the fleet gets this
        replica's unspent grants at once instead of losing them)."""
        ops = self._take_all()
        if self.store is not None and ops:
            await self._send_all(ops)
        await self.drain()
        # a renewal on its way meanwhile landed a grant here: it goes back too
        if self.store is not None and (ops := self._take_all()):
            await self._send_all(ops)

    def retire(self) -> None:
        """A reload replaced this limiter: give back everything held now, in the background
        (:meth:`drain` waits for it); a request still answered by the old limiter that takes
        a grant after it gives that back within ``sync_interval``, as any grant."""
        ops = self._take_all()
        if self.store is None:
            return
        try:
            if ops:
                self._spawn(self._send_all(ops))
            if self.renews_after_retire:
                self._arm()
        except RuntimeError:  # no event loop: nothing was ever taken
            pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _arm(self) -> None:
        if self._timer is None and self.store is not None:
            self._timer = asyncio.get_running_loop().call_later(self.period, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._spawn(self.sync())
        if self.busy():
            self._arm()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def sending(self) -> bool:
        """Whether a store call of this table is on its way (:meth:`drain` waits for it)."""
        return bool(self._tasks)

    async def drain(self) -> None:
        """Wait for the store calls already sent (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        """Stop the timer and the calls on their way (what is held is lost: it only refuses
        early)."""
        self._stop_timer()
        for task in self._tasks:
            task.cancel()


class GrantTable(Synced):
    """One limiter's grants, by bucket key, on this replica."""

    def __init__(self, sync_interval: float, clock: Clock = SYSTEM_CLOCK,
                 give_back: GiveBack = bucket_return, renew: Renew | None = None,
                 spend_within: float | None = None, store: Store | None = None) -> None:
        super().__init__(store)
        self.sync_interval = sync_interval
        #: a grant held this long after the store yielded it is neither spent nor given
        #: back but dropped (a token bucket's: the bucket refilled meanwhile, up to
        #: ``burst``, so its tokens spent or returned then would yield more at that instant
        #: than the exact limiter; dropped, they only refuse early). None: kept (a quota's
        #: grant belongs to its window, which counts it whenever it is spent)
        self.spend_within = spend_within
        self.period = sync_interval / TICKS
        self._clock = clock
        self._op = give_back
        #: None: a due grant only goes back (a quota: its next window is another count)
        self._renew = renew
        self._held: dict[str, _Held] = {}
        #: key -> when a grant for it was asked (:meth:`lend`, clock.monotonic): the grant
        #: that answers it was taken no earlier, whatever the answer waited for
        self._asked: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def held(self, key: str) -> float:
        """Unspent granted tokens held for ``key`` that :meth:`spend` would still spend (0
        when none, or when the grant is stale: :meth:`_expired`; read only, nothing dropped)."""
        h = self._held.get(key)
        if h is None or self._expired(h, self._clock.monotonic()):
            return 0.0
        return h.tokens

    def total(self) -> float:
        return sum(h.tokens for h in self._held.values())

    def keys_held(self) -> int:
        return len(self._held)

    def spend(self, key: str, cost: float, numbers: Numbers) -> float | None:
        """Spend ``cost`` from the grant held for ``key``: the ``remaining`` to answer
        (grant left + the shared bucket's last known tokens), or None when the grant does
        not cover it, was taken for other numbers (a plan or override changed) or is stale
        (:meth:`_stale`: dropped)."""
        h = self._held.get(key)
        if h is None or h.numbers != numbers or not admits(h.tokens, cost):
            return None
        now = self._clock.monotonic()
        if self._stale(h, now):
            return None
        h.tokens = take(h.tokens, cost)
        h.spent_at = now
        if h.tokens <= 0.0:
            h.empty_since = now
        self.local += 1
        return h.tokens + h.shared

    def lend(self, key: str, numbers: Numbers) -> float:
        """The remainder held for ``key`` (too small for the request that asks), taken out
        to go back with the grant the request asks for (``GrantOp.held``): the store counts
        it in the pool it grants from. :meth:`granted` or :meth:`restore` follows."""
        now = self._clock.monotonic()
        if now - self._asked.get(key, float("-inf")) >= self.sync_interval:  # none, or one left unanswered
            self._asked[key] = now
        h = self._held.get(key)
        if h is None or h.numbers != numbers or h.tokens <= 0.0 or self._stale(h, now):
            return 0.0
        held, h.tokens = h.tokens, 0.0
        h.empty_since = self._clock.monotonic()
        return held

    def _stale(self, h: _Held, now: float) -> bool:
        """Whether ``h`` was taken ``spend_within`` ago or more (its replica stood still: its
        timer did not give it back in time): then its tokens are dropped here, unspent, and
        counted (``dropped``)."""
        if not self._expired(h, now) or h.tokens <= 0.0:
            return False
        self.dropped += h.tokens
        h.tokens = 0.0
        h.empty_since = now
        return True

    def _expired(self, h: _Held, now: float) -> bool:
        """Whether ``h`` was taken ``spend_within`` ago or more: never spent then."""
        return self.spend_within is not None and now - h.taken_at >= self.spend_within

    def restore(self, key: str, held: float, numbers: Numbers) -> None:
        """The grant asked with ``held`` was not committed: the remainder stays here."""
        self._asked.pop(key, None)
        if held <= 0.0:
            return
        h = self._held.get(key)
        if h is None or h.numbers != numbers:
            self._give_back([(key, numbers, held)])
            return
        h.tokens += held
        self._arm()

    def granted(self, key: str, amount: float, cost: float, shared: float, want: float,
                numbers: Numbers, sent: float | None = None) -> float:
        """The store granted ``amount`` tokens for ``key`` (``shared`` left there) to a
        request of ``cost``, which spends its cost from it at once. Returns ``remaining``.
        The grant counts as taken when it was asked (``sent``, else :meth:`lend`'s time)."""
        now = self._clock.monotonic()
        taken = min(now, self._asked.pop(key, now) if sent is None else sent)
        self.grants += 1
        h = self._held.get(key)
        if h is None or h.numbers != numbers:
            if h is not None and h.tokens > 0.0:  # taken with other numbers: give it back
                self._give_back([(key, h.numbers, h.tokens)])
            h = self._held[key] = _Held(0.0, shared, taken, now, numbers)
        if h.tokens <= 0.0:
            h.taken_at = taken
        h.tokens = take(h.tokens + amount, cost)
        h.shared = shared
        h.want = want
        if cost > 0.0:
            h.spent_at = now
        if h.tokens > want:  # grants that landed together: keep one, the rest goes back now
            self._give_back([(key, numbers, h.tokens - want)])
            h.tokens = want
        if h.tokens <= 0.0:
            h.empty_since = now
        self._arm()
        return h.tokens + h.shared

    def due(self) -> list[Op]:
        """Take out what goes back now: every grant at least half a ``sync_interval`` old
        (the timer runs every half interval), renewed when the table renews and a request
        spent from it in the last half interval (so a key whose traffic stopped holds nothing
        one interval later, as without renewals); forget keys empty for a whole interval."""
        now = self._clock.monotonic()
        half = self.sync_interval / TICKS
        out: list[Op] = []
        for key, h in list(self._held.items()):
            if self._stale(h, now):
                continue
            if h.tokens > 0.0 and now - h.taken_at >= half:
                renew = self._renew if now - h.spent_at <= half else None
                out.append(self._op(key, h.numbers, h.tokens) if renew is None
                           else renew(key, h.numbers, h.tokens, h.want))
                self.expired += 1
                h.tokens = 0.0
                h.empty_since = now
            elif h.tokens <= 0.0 and now - h.empty_since >= self.sync_interval:
                del self._held[key]
        for key in [k for k, at in self._asked.items() if now - at >= self.sync_interval]:
            del self._asked[key]  # asked, never answered (the store failed open)
        return out

    async def sync(self) -> int:
        """One sync turn: give back (or renew) what is due (:meth:`due`), in store calls of
        :data:`SEND_CHUNK` ops (each its own ``check.lua`` entry; the Redis store sends them
        with the next check); a renewal's new grant is held here. Returns how many went back."""
        due = self.due()
        if due and self.store is not None:
            sent = self._clock.monotonic()
            for op, result in zip(due, await self._send_all(due), strict=True):
                if isinstance(op, GrantOp) and result is not None and result.extra > 0.0:
                    self.granted(op.key, result.extra, 0.0, result.remaining, op.want, (op.rate, op.burst),
                                 sent)
        return len(due)

    async def _send(self, ops: Sequence[Op]) -> list[OpResult | None]:
        assert self.store is not None
        try:
            result = await self.store.check(ops, "")
        except Exception:  # a lost return only refuses early: counted, never raised
            self.return_errors += len(ops)
            return [None] * len(ops)
        self.returned += sum(given_back(op) for op in ops)
        for op, res in zip(ops, result.results, strict=True):
            self._early(op, res)
        return list(result.results)

    def _early(self, op: Op, res: OpResult) -> None:
        """Observe a bucket's give-back (a return, or a renewal's ``held``) that stood here
        while the bucket could not pay one token (:meth:`unspent_at_limit`): the bucket's
        tokens before it follow from the answer (:func:`~extauthz.store.algorithms.give_back`,
        :func:`~extauthz.store.algorithms.grant_pool`), unless it was full. A quota's
        give-back carries no limit: not observed."""
        if isinstance(op, ReturnOp):
            after, amount = res.remaining, op.amount
        elif isinstance(op, GrantOp) and op.held > 0.0 and res.extra >= 0.0:
            after, amount = res.remaining + res.extra, op.held  # the pool it granted from
        else:
            return
        if after < op.burst and not admits(after - amount, 1.0):
            self.unspent_at_limit(amount)

    def _give_back(self, returns: Iterable[tuple[str, Numbers, float]]) -> None:
        if self.store is None:
            return
        ops = [self._op(key, numbers, amount) for key, numbers, amount in returns]
        if ops:
            self._spawn(self._send_all(ops))

    def busy(self) -> bool:
        return bool(self._held)

    def _take_all(self) -> list[Op]:
        """Stop the timer and take out everything held (to go back)."""
        self._stop_timer()
        now = self._clock.monotonic()
        returns = [self._op(key, h.numbers, h.tokens) for key, h in self._held.items()
                   if not self._stale(h, now) and h.tokens > 0.0]
        self._held.clear()
        return returns



class GrantBook:
    """This replica's batched grants, for the engine: built with its store, it follows the
    limiters of each snapshot (:meth:`adopt`) and owns what the engine does with grants: a
    refused request's refund, the leases admitted requests hold in local fleet slots, a
    finished request's local release, a reload's retire, a graceful stop's settle, the
    give-back of grants whose request failed open, and the status and metrics figures."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: a Redis Cluster (grant ops of one call may run on several masters)
        self._per_master = store.per_master
        #: the current snapshot's limiters, and those of them that take grants
        self.limiters: tuple[Limiter, ...] = ()
        #: whether an engine's limiters were adopted: a book follows one engine's snapshots
        #: (a second engine's adopt would retire the first one's grant tables under it)
        self.adopted = False
        self._batched: tuple[Limiter, ...] = ()
        #: grants that hold leases (fleet slots), current and retired until they hold nothing:
        #: a release finds its slot there before it goes to the store (:meth:`release`)
        self._slots: list[GrantHolder] = []
        #: whether admitted requests may hold a lease in a local grant (:meth:`hold`)
        self.holds_leases = False
        #: the current policy's longest lease TTL: how long a failed release is retried
        self.lease_ttl = 0.0
        #: batched grants of failed-open requests given back (:meth:`give_back`), and those
        #: give-backs that failed
        self.abandoned_returns = 0
        self.abandoned_return_errors = 0
        self._returning: set[asyncio.Task[None]] = set()

    def adopt(self, limiters: tuple[Limiter, ...], lease_ttl: float) -> None:
        """The limiters of a new snapshot (``lease_ttl``: its policy's longest lease TTL).
        Every grant table of the previous ones that the new ones do not keep gives back what
        it holds at once (:meth:`Synced.retire`); the new limiters take their own grants,
        with their own numbers. Nothing is admitted twice: a grant is spent only by the table
        that took it, and what goes back only refills the shared count."""
        old, self.limiters = self.limiters, limiters
        self.lease_ttl = lease_ttl
        self.adopted = True
        if old is limiters:
            return
        self._batched = tuple(lim for lim in limiters if lim.grants is not None)
        self._slots = [t for t in self._slots if not t.done]
        self._slots.extend(lim.grants for lim in limiters if lim.holds_leases and lim.grants is not None)
        self.holds_leases = bool(self._slots)
        kept = {id(lim) for lim in limiters}
        for lim in old:
            if id(lim) not in kept and lim.grants is not None:
                lim.grants.retire()

    def retry_for(self) -> float:
        """How long a failed release is tried again (:class:`~extauthz.engine.release.Releaser`)."""
        return self.lease_ttl

    # -- the request path -----------------------------------------------------------------
    def refund(self, ctx: RequestContext, slots: Iterable[Slot]) -> None:
        """A refused request takes nothing (as in exact mode, where only an admitted request
        commits): what batched limiters spent for it from their grants goes back to them."""
        for lim, _, local, _ in slots:
            if local is not None and not local.refused and lim.grants is not None:
                lim.refund(ctx)

    def hold(self, ctx: RequestContext, slots: Iterable[Slot], lease_id: str, admitted: bool) -> list[str]:
        """The lease keys an admitted request holds in local grants (named ``lease_id``); a
        refused one gives the slots it took back."""
        held: list[str] = []
        for lim, _, _, _ in slots:
            if lim.holds_leases:
                if not admitted:
                    lim.refund(ctx)
                elif (key := lim.hold(ctx, lease_id)) is not None:
                    held.append(key)
        return held

    def release(self, keys: Sequence[str], lease_id: str) -> tuple[list[str], int]:
        """The keys of a release that still go to the store, and how many leases were given
        back to a local grant instead (:meth:`~extauthz.limiters.fleet.FleetSlots.release`)."""
        if not self._slots:
            return list(keys), 0
        left: list[str] = []
        local = 0
        for key in keys:
            if any(t.release(key, lease_id) for t in self._slots):
                local += 1
            else:
                left.append(key)
        return left, local

    def give_back(self, ops: Sequence[Op], result: CheckResult | None) -> None:
        """Issue 29: a batched grant op whose request was failed open (deadline, breaker,
        error) must not cost the key its grant. The request's answer never reached its
        limiter, so nothing holds what the store granted (without this, each abandoned grant
        took ``batch`` tokens from the shared bucket for nothing: a key refused while its
        bucket had been spent on no request). ``result``: the late answer of a call that ran
        (its grants, less the failed-open request's own cost, as exact mode's late commit
        takes it, go back); None: the call committed nothing (never sent, or failed unsent),
        so the remainder it lent (``held``) goes back. A late answer that cannot be known
        (connection lost) gives nothing back: only refusing early, never admitting more. The
        give-backs ride with the next check, as every return does."""
        back: list[Op] = []
        for i, op in enumerate(ops):
            if not isinstance(op, GrantOp):
                continue
            if result is None:
                amount = 0.0 if self._per_master else op.held  # a cluster group may have run
            else:
                res = result.results[i]
                amount = res.extra - op.cost if result.admitted and res.allowed and res.extra > 0 else 0.0
            if amount > 0.0:
                back.append(ReturnOp(op.key, op.rate, op.burst, amount))
        if back:
            self.abandoned_returns += len(back)
            task = asyncio.get_running_loop().create_task(self._send_returns(back))
            self._returning.add(task)
            task.add_done_callback(self._returning.discard)

    async def _send_returns(self, ops: list[Op]) -> None:
        try:
            await self.store.check(ops, "")
        except Exception:  # a lost give-back only refuses early (counted, never raised)
            self.abandoned_return_errors += len(ops)

    # -- a graceful stop, status ----------------------------------------------------------
    async def settle(self) -> None:
        """A graceful stop: every batched limiter gives back what it holds at once
        (:meth:`Synced.settle`), and the give-backs of failed-open requests on their way
        (:meth:`give_back`) land."""
        for lim in self._batched:
            if lim.grants is not None:
                await lim.grants.settle()
        while self._returning:
            await asyncio.gather(*list(self._returning), return_exceptions=True)

    def status(self) -> dict[str, dict[str, float]]:
        """Every batched limiter's :meth:`Synced.status`, by limiter name (/status, /metrics)."""
        return {lim.name: lim.grants.status() for lim in self._batched if lim.grants is not None}

    def early(self) -> dict[str, tuple[list[tuple[str, float]], float]]:
        """Every batched limiter's early-refusal histogram, by limiter name: cumulative
        ``(le, count)`` buckets (+Inf last) and the sum (/metrics)."""
        return {lim.name: lim.grants.early_refusals() for lim in self._batched if lim.grants is not None}


#: :meth:`GrantTable.status` fields on /metrics: field -> (metric name, counter?, help);
#: labelled by limiter. Counters count since the limiter was built (a reload starts anew).
GRANT_METRICS: Final = {
    "grants_taken": ("extauthz_grants_taken", True, "Batched grants taken from the store."),
    "grants_expired": ("extauthz_grants_expired", True, "Batched grants given back unspent "
                       "because sync_interval passed."),
    "returned": ("extauthz_grant_returned", True, "Unspent granted tokens or quota units "
                 "given back to the store (any reason)."),
    "return_errors": ("extauthz_grant_return_errors", True, "Give-backs that failed (their "
                      "amount only refuses early until the store refills it)."),
    "store_calls_saved": ("extauthz_grant_store_calls_saved", True, "Requests answered from a "
                          "batched grant held here: store calls saved."),
    "overadmission": ("extauthz_overadmission", True, "Requests admitted past the exact "
                      "limiter's count, as far as the store can tell (must stay 0; see "
                      "docs/limiters.md)."),
    "dropped": ("extauthz_grant_dropped", True, "Granted tokens dropped unspent because this "
                "replica held them past sync_interval (it stood still): only early refusals."),
    "held": ("extauthz_grants_held", False, "Granted tokens or quota units held here, unspent."),
    "keys": ("extauthz_grant_keys", False, "Keys this replica holds or recently held grants for."),
}
