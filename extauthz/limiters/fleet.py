"""Fleet usage load shedder: ``capacity`` in-flight requests for the whole fleet.

Non-critical requests are refused (503) once non-critical in-flight reaches
``floor((1 - reserved_for_critical) * capacity)``; critical requests hold a lease too
(they are counted for metrics and the utilization signal) but are never refused here.

``consistency: batched`` (:class:`FleetSlots`): a replica takes ``batch`` fleet slots at a
time as a grant, members of the tier's lease ZSET with an expiry score
(:class:`~extauthz.store.base.FleetGrantOp`, the rule in
:mod:`extauthz.store.algorithms`), renews them while it holds them and admits a request
into a free slot of its grant without a store call. A finished request's lease (released
through the one release path, :class:`~extauthz.engine.release.Releaser`) frees its slot in the
LOCAL grant; slots unused for ``sync_interval`` go back (the grant shrinks). A non-critical
grant grows only while the non-critical leases (every replica's grant members and exact
leases) leave a slot free, so no more non-critical requests are in flight than the exact
limiter admits; a replica may refuse while others hold free slots: at most
``batch x (replicas - 1)`` early, until their slots go back.

Stalls (a replica stopped, starved or killed): a replica admits into its grant only within
the grant TTL (:func:`grant_ttl`) of the last renewal it sent, and the store keeps the
grant's members for that TTL plus ``lease_ttl`` (:attr:`FleetSlots.life`), so a slot taken
at the last moment is counted as long as an exact lease taken then would be, however long
the replica then stands still: the others never take it meanwhile. A renewal carries the
slots in use (``used``) and the store restores those that expired anyway (a stall past
``lease_ttl``, a Redis that lost them), past ``limit`` if the others took them meanwhile:
those requests are in flight, every replica then refuses until they finish, and the
leases counted past ``limit`` are counted as overadmission (:attr:`Synced.overadmitted`).
The cost: a replica killed holds its free slots (at most ``batch``) for ``life`` instead
of the TTL, as an exact lease of a killed replica is held for ``lease_ttl``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Final

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.context import RequestContext
from ..core.tiers import Tier
from ..core.verdict import Outcome, Quota, Verdict
from ..policy.schema import DEFAULT_FLEET_BATCH_MAX, FleetUsageSpec
from ..store.base import FleetGrantOp, LeaseOp, OpResult, Store
from ..store.keys import Keys
from .base import FleetWide, denied_outcome
from .grants import Synced

__all__ = ["FleetSlots", "FleetUsageShedder", "default_fleet_batch", "grant_ttl"]

RETRY_AFTER = 2.0
#: the grant TTL in sync_intervals (at least 1 s, at most the lease TTL): a replica spends
#: from its grant only this long after the last renewal it sent (its slots live this long
#: plus the lease TTL: :attr:`FleetSlots.life`)
TTL_INTERVALS: Final = 10


def default_fleet_batch(limit: int) -> int:
    """The documented default ``batch`` of fleet_usage: 1% of the tier's limit (the
    non-critical share of ``capacity``), at least 1 slot, at most ``DEFAULT_FLEET_BATCH_MAX``
    (a grant's slots are sorted-set members renewed every sync)."""
    return min(DEFAULT_FLEET_BATCH_MAX, max(1, limit // 100))


def grant_ttl(sync_interval: float, lease_ttl: float) -> float:
    """How long a replica spends from a grant after the last renewal it sent:
    ``TTL_INTERVALS`` sync intervals, at least 1 s, at most ``lease_ttl``; the store keeps
    the grant's slots this long plus ``lease_ttl`` (:attr:`FleetSlots.life`)."""
    return min(lease_ttl, max(1.0, TTL_INTERVALS * sync_interval))


class _Grant:
    """One tier's grant on this replica: ``size`` members of the fleet ZSET ``key`` named
    ``<gid>:0 .. <gid>:size-1``, ``used`` of them by requests in flight here."""

    __slots__ = ("asked", "gid", "key", "leases", "limit", "low", "low_since", "over", "renewed_at",
                 "shared", "size")

    def __init__(self, key: str, limit: int, now: float) -> None:
        self.key = key
        self.limit = limit
        self.gid = os.urandom(6).hex()
        self.size = 0
        #: lease id -> when it expires here (the lease TTL: a lost access-log entry)
        self.leases: dict[str, float] = {}
        #: fewest free slots since ``low_since`` (what was unused all that time)
        self.low = 0
        self.low_since = now
        #: when the last renewal the store answered was sent (its members live until at
        #: least + life; this replica spends from the grant only until + ttl)
        self.renewed_at = now
        #: leases past ``limit`` at the last store answer (:func:`~extauthz.store.algorithms.fleet_grant_over`)
        self.over = 0
        #: free slots of ``limit`` at the last store answer (the ``remaining`` header)
        self.shared = 0.0
        #: when a store call for this grant was sent and not answered yet (None: none)
        self.asked: float | None = None

    @property
    def used(self) -> int:
        return len(self.leases)

    @property
    def free(self) -> int:
        return max(0, self.size - len(self.leases))


class FleetSlots(Synced):
    """A batched fleet_usage limiter's grants on this replica (one per tier key), with the
    counters and life cycle of :class:`~extauthz.limiters.grants.GrantTable` (status,
    store, retire, settle, drain, close)."""

    renews_after_retire = True

    def __init__(self, keys: tuple[tuple[str, int], ...], *, batch: int, sync_interval: float,
                 lease_ttl: float, clock: Clock = SYSTEM_CLOCK, store: Store | None = None) -> None:
        super().__init__(store)
        self.sync_interval = sync_interval
        self.batch = batch
        self.lease_ttl = lease_ttl
        self.ttl = grant_ttl(sync_interval, lease_ttl)
        #: how long the store keeps a renewed grant's members: a slot taken ``ttl`` after the
        #: renewal is counted ``lease_ttl`` after that, as an exact lease would be
        self.life = self.ttl + lease_ttl
        #: the timer's period: renewals well inside the TTL, give-backs within sync_interval
        self.period = min(sync_interval / 2, self.ttl / 4)
        self._clock = clock
        now = clock.monotonic()
        self._grants = {key: _Grant(key, limit, now) for key, limit in keys}
        #: request (id of its context) -> the grant a slot was taken from, until the engine
        #: names its lease (:meth:`hold`) or the request is refused (:meth:`refund`)
        self._taken: dict[int, tuple[_Grant, float]] = {}
        #: request (id of its context) -> the grant a growth was asked for
        self._asked: dict[int, _Grant] = {}
        self.retired = False

    def grant(self, key: str) -> _Grant:
        return self._grants[key]

    def keys_held(self) -> int:
        return sum(1 for g in self._grants.values() if g.size)

    def total(self) -> float:
        return float(self.held())

    def held(self) -> int:
        """Free slots held here (taken from the fleet, unused)."""
        return sum(g.free for g in self._grants.values())

    # -- the request path ------------------------------------------------------------
    def spend(self, ctx: RequestContext, key: str) -> float | None:
        """Take a free slot of the grant for ``key`` (the ``remaining`` to answer), or None
        when it has none (or has not been renewed within its TTL)."""
        g = self._grants[key]
        now = self._clock.monotonic()
        if self.retired or g.free <= 0 or now - g.renewed_at >= self.ttl:
            return None
        self._take(ctx, g, now)
        self.local += 1
        return g.shared + g.free

    def hold_pending(self, ctx: RequestContext) -> bool:
        """Whether :meth:`spend` took a slot for ``ctx`` (its lease not named yet)."""
        return id(ctx) in self._taken

    def _take(self, ctx: RequestContext, g: _Grant, now: float) -> None:
        g.leases[f"\0{id(ctx)}"] = now + self.lease_ttl  # named by hold()
        self._taken[id(ctx)] = (g, now)
        g.low = min(g.low, g.free)

    def ask(self, ctx: RequestContext, key: str, enforce: bool) -> FleetGrantOp | LeaseOp:
        """The store op of a request the grant cannot serve: a growth of the grant, or an
        exact lease while another growth of it is on its way (one at a time per grant)."""
        g = self._grants[key]
        now = self._clock.monotonic()
        if self.retired or (g.asked is not None and now - g.asked < self.sync_interval):
            return LeaseOp(key, g.limit, self.lease_ttl, enforce)
        g.asked = now
        self._asked[id(ctx)] = g
        return FleetGrantOp(key, g.limit, self.life, g.gid, g.size, self.batch, enforce, g.used)

    def answered(self, ctx: RequestContext, result: OpResult) -> None:
        """The store's answer to a growth (:meth:`ask`): the grant's new size; a request
        it grew for takes one of the new slots."""
        g = self._asked.pop(id(ctx), None)
        if g is None:
            return
        sent, g.asked = g.asked, None
        g.shared = result.remaining
        if result.extra < 0 or sent is None:  # nothing committed: the grant stands as it was
            return
        now = self._clock.monotonic()
        self._renewed(g, result, sent)
        if result.allowed and g.free > 0:
            self.grants += 1
            self._take(ctx, g, now)
            g.low, g.low_since = g.free, now
        self._arm()

    def _renewed(self, g: _Grant, result: OpResult, sent: float) -> None:
        """The store renewed ``g`` (an answer to an op sent at ``sent``): its new size, and
        the leases it counts past ``limit`` (a rise is overadmission: slots in use restored
        after others took them; every replica's renewal sees it, the answer does not say
        whose slots were restored, so the fleet's figure is the largest replica's)."""
        g.size = int(result.extra)
        g.renewed_at = sent
        over = int(result.retry_after)
        self.overadmitted += max(0, over - g.over)
        g.over = over

    def hold(self, ctx: RequestContext, lease_id: str) -> str | None:
        """An admitted request took a slot here: its lease is ``lease_id`` (the key it
        names, for the answer's lease metadata), or None when it took none."""
        asked = self._asked.pop(id(ctx), None)
        if asked is not None:  # no answer came (the store failed open): ask again later
            asked.asked = None
        taken = self._taken.pop(id(ctx), None)
        if taken is None:
            return None
        g = taken[0]
        expires = g.leases.pop(f"\0{id(ctx)}", None)
        if expires is None:
            return None
        g.leases[lease_id] = expires
        return g.key

    def refund(self, ctx: RequestContext) -> None:
        """The request was refused (or asked nothing): its slot is free again."""
        g = self._asked.pop(id(ctx), None)
        if g is not None:  # a growth never sent (another limiter refused first)
            g.asked = None
        taken = self._taken.pop(id(ctx), None)
        if taken is not None:
            taken[0].leases.pop(f"\0{id(ctx)}", None)

    def release(self, key: str, lease_id: str) -> bool:
        """A finished request gives its slot back to the local grant (True), if it held one."""
        g = self._grants.get(key)
        if g is None or g.leases.pop(lease_id, None) is None:
            return False
        if g.free > self.batch and g.asked is None and self.store is not None:
            # never more than one batch free here (the early-refusal bound): the rest goes back
            g.asked = self._clock.monotonic()
            try:
                self._spawn(self._send([FleetGrantOp(g.key, g.limit, self.life, g.gid, g.size,
                                                     self.batch - g.free, False, g.used)]))
            except RuntimeError:  # no event loop: the next sync turn gives it back
                g.asked = None
        return True

    # -- the sync turn ---------------------------------------------------------------
    def due(self) -> list[FleetGrantOp]:
        """The renewals and give-backs of this turn: every grant renewed; slots unused for
        ``sync_interval`` (all free ones once retired) given back; leases past their TTL
        and requests never named dropped."""
        now = self._clock.monotonic()
        for ident, (g, at) in list(self._taken.items()):
            if now - at >= self.sync_interval:  # a decision that never finished
                del self._taken[ident]
                g.leases.pop(f"\0{ident}", None)
        out: list[FleetGrantOp] = []
        for g in self._grants.values():
            for lease_id in [lid for lid, exp in g.leases.items() if exp <= now]:
                del g.leases[lease_id]
            g.low = min(g.low, g.free)
            if g.size == 0 or (g.asked is not None and now - g.asked < self.sync_interval):
                continue
            back = g.free if self.retired else (g.low if now - g.low_since >= self.sync_interval else 0)
            back = max(back, g.free - self.batch)  # never more than one batch free here
            if now - g.low_since >= self.sync_interval:
                g.low, g.low_since = g.free - back, now
            if back:
                self.expired += 1
            g.asked = now
            out.append(FleetGrantOp(g.key, g.limit, self.life, g.gid, g.size, -back, False, g.used))
        return out

    async def sync(self) -> int:
        """One sync turn (:meth:`due`) in one store round. Returns the slots given back."""
        ops = self.due()
        if not ops or self.store is None:
            for op in ops:
                self._grants[op.key].asked = None
            return 0
        return sum(await self._send_all(ops))

    async def _send(self, ops: Sequence[FleetGrantOp]) -> list[int]:
        """Renew or shrink grants (one store call); the slots each gave back."""
        assert self.store is not None
        grants = [self._grants[op.key] for op in ops]
        sent = self._clock.monotonic()
        try:
            result = await self.store.check(ops, "")
        except Exception:  # the grants live on until their TTL; the next turn renews them
            self.return_errors += len(ops)
            return [0] * len(ops)
        finally:
            for g in grants:
                g.asked = None
        out = []
        for op, g, res in zip(ops, grants, result.results, strict=True):
            given = max(0, g.size - int(res.extra)) if res.extra >= 0 else 0
            if op.limit > 0 and res.remaining - given <= 0:  # the fleet was full without them
                self.unspent_at_limit(float(given))
            if g.gid == op.grant and res.extra >= 0:
                self._renewed(g, res, sent)
                g.shared = res.remaining
            self.returned += given
            if given:
                g.low = min(g.low, g.free)
            out.append(given)
        return out

    def busy(self) -> bool:
        return any(g.size or g.leases for g in self._grants.values())

    def _take_all(self) -> list[FleetGrantOp]:
        """Give back every free slot (shrink each grant to its used slots)."""
        self.retired = True
        out = []
        for g in self._grants.values():
            if g.free:
                out.append(FleetGrantOp(g.key, g.limit, self.life, g.gid, g.size, -g.free, False, g.used))
        return out

    @property
    def done(self) -> bool:
        """Retired and holding nothing any more."""
        return self.retired and not self.busy()


class FleetUsageShedder(FleetWide):
    def __init__(self, spec: FleetUsageSpec, keys: Keys, clock: Clock = SYSTEM_CLOCK,
                 store: Store | None = None) -> None:
        super().__init__(spec)
        self.capacity = spec.capacity
        self.noncritical_limit = max(1, math.floor((1 - spec.reserved_for_critical) * spec.capacity + 1e-9))
        self.ttl = spec.lease_ttl
        self.critical_key = keys.fleet_leases(self.name, "critical")
        self.other_key = keys.fleet_leases(self.name, "other")
        self.quota = Quota(limit=self.noncritical_limit, window=None, unit="concurrent-requests")
        #: batched grants of fleet slots (``consistency: batched``), else None
        self.grants: FleetSlots | None = None
        if spec.consistency == "batched":
            batch = int(spec.batch) if spec.batch is not None else default_fleet_batch(self.noncritical_limit)
            self.grants = FleetSlots(((self.critical_key, 0), (self.other_key, self.noncritical_limit)),
                                     batch=batch, sync_interval=spec.sync_interval,
                                     lease_ttl=spec.lease_ttl, clock=clock, store=store)
        #: admitted requests may hold a lease in a local grant (:meth:`.grants.GrantBook.hold`)
        self.holds_leases = self.grants is not None

    @property
    def lease_keys(self) -> tuple[str, str]:
        return self.critical_key, self.other_key

    def _key(self, ctx: RequestContext) -> str:
        return self.critical_key if ctx.tier is Tier.CRITICAL else self.other_key

    def local(self, ctx: RequestContext, enforce: bool) -> Verdict | None:
        if self.grants is None:
            return None
        remaining = self.grants.spend(ctx, self._key(ctx))
        if remaining is None:
            return None
        if ctx.tier is Tier.CRITICAL:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.capacity)
        return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.noncritical_limit,
                       remaining=remaining, quota=self.quota)

    def op(self, ctx: RequestContext, enforce: bool) -> LeaseOp | FleetGrantOp | None:
        if self.grants is not None:
            if self.grants.hold_pending(ctx):
                return None  # local() took a slot of the grant
            return self.grants.ask(ctx, self._key(ctx), enforce)
        if ctx.tier is Tier.CRITICAL:
            return LeaseOp(self.critical_key, 0, self.ttl, enforce)
        return LeaseOp(self.other_key, self.noncritical_limit, self.ttl, enforce)

    def refund(self, ctx: RequestContext) -> None:
        if self.grants is not None:
            self.grants.refund(ctx)

    def hold(self, ctx: RequestContext, lease_id: str) -> str | None:
        """The lease key of a slot an admitted request took from the local grant, or None."""
        return None if self.grants is None else self.grants.hold(ctx, lease_id)

    def verdict(self, ctx: RequestContext, result: OpResult, enforce: bool) -> Verdict:
        remaining = result.remaining
        if self.grants is not None:
            self.grants.answered(ctx, result)
            remaining += self.grants.grant(self._key(ctx)).free
        if ctx.tier is Tier.CRITICAL:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.capacity)
        if result.allowed:
            return Verdict(self.name, self.kind, Outcome.ALLOWED, limit=self.noncritical_limit,
                           remaining=remaining, quota=self.quota)
        return Verdict(self.name, self.kind, denied_outcome(enforce), limit=self.noncritical_limit,
                       remaining=0.0, retry_after=RETRY_AFTER, reason="fleet_capacity_reserved",
                       quota=self.quota,
                       detail=(f"The API is at capacity for non-critical traffic (load shedder "
                               f"'{self.name}'); the remaining capacity is reserved for critical "
                               f"requests. Retry later with backoff."))
