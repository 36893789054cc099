"""The engine: classify, run every applicable limiter, decide. No grpc here.

This module is the one place that decides fail-open: a store error, a missed deadline, an
open circuit breaker or an unexpected exception (``internal_error``) becomes an allowed
verdict (``failed_open``) for limiters with ``failure_mode: open`` and a 503
(``failed_closed``) for those with ``failure_mode: closed``, counted by reason
(:attr:`Engine.failures`, exported as ``extauthz_fail_open_total{reason}``).
Leases go back through :class:`~extauthz.release.Releaser` (``Engine.releaser``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from .breaker import Breaker
from .classify import Classifier
from .clock import SYSTEM_CLOCK, Clock
from .context import RawRequest, RequestContext
from .errors import INTERNAL_ERROR, CircuitOpen, Overloaded, StoreError, StoreInternalError, StoreTimeout
from .limiters import Limiter, WorkerUtilizationShedder, build_limiters
from .limiters.base import FleetWide, applies
from .limiters.fleet import LocalSlots
from .limiters.grants import bind_store, hold_leases, refund_grants, retire_grants, settle_grants
from .limiters.worker import keep_levels, workers_of
from .observe.base import NullObserver, Observer
from .overrides import Override, compile_overrides
from .policy.model import Policy
from .release import Releaser
from .settings import STORE_DEADLINE_MS
from .store.base import CheckResult, GrantOp, LeaseOp, Op, ReturnOp, Store
from .store.keys import Keys
from .switches import Switches
from .throttle import LogThrottle
from .verdict import Decision, Mode, Outcome, Verdict

log = logging.getLogger("extauthz.engine")

#: times a check's store deadline may be given again when the store is not late: the check
#: still queued in this server, or its answer not yet carried by the server's own busy loop
#: (:meth:`Engine._answer`): a bound (each pass at most one deadline: 100 ms at the default
#: 5 ms, below Envoy's 250 ms; what bounds a starved server's answers is its overload
#: budget, not the store deadline). 3 failed open a third of a loaded cluster's checks whose
#: answers Redis had given in time (issue 29).
LOOP_EXTENSIONS = 20
#: where a check was when its store deadline passed (``extauthz_store_deadline_missed_total``)
DEADLINE_WHERE: Final = ("queued", "redis", "loop")


class StoreLate(TimeoutError):
    """A check's store deadline passed (:meth:`Engine._answer`): ``masters`` the store's
    masters that were late (``()``: the store, unnamed), or None when the store was not the
    one that was late (no breaker counts it)."""

    def __init__(self, masters: Sequence[str] | None) -> None:
        super().__init__("store deadline")
        self.masters = masters

#: the store call of a check: ``Store.check`` or a wrapper around it
StoreCheck = Callable[[Sequence[Op], str], Awaitable[CheckResult]]


def failed_verdict(lim: Limiter, reason: str) -> Verdict:
    """A limiter's verdict when it cannot decide: allowed (``failed_open``) or a 503
    (``failed_closed``, retry after 1 s) per its ``failure_mode``."""
    if lim.failure_mode == "closed":
        return Verdict(lim.name, lim.kind, Outcome.FAILED_CLOSED, retry_after=1.0, reason=reason)
    return Verdict(lim.name, lim.kind, Outcome.FAILED_OPEN, reason=reason)


def _active(policy: Policy, limiters: Sequence[Limiter],
            switches: Switches) -> tuple[tuple[Limiter, bool], ...]:
    """(limiter, enforce) for every limiter whose effective mode is not ``off``."""
    modes = {spec.name: Mode(spec.mode) for spec in policy.limiters}
    return tuple(
        (lim, mode is Mode.ENFORCE)
        for lim in limiters
        if (mode := switches.effective(lim.name, modes[lim.name])) is not Mode.OFF
    )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a decision reads, replaced as a whole on reload or switch change."""

    policy: Policy
    classifier: Classifier
    limiters: tuple[Limiter, ...]
    #: (limiter, enforce) for every limiter whose effective mode is not ``off``.
    active: tuple[tuple[Limiter, bool], ...]
    switches: Switches
    #: live overrides that do not apply, and why: ``(limiter, identity) -> reason``.
    overrides_not_applied: Mapping[tuple[str, str], str] = field(default_factory=dict)

    @property
    def workers(self) -> tuple[WorkerUtilizationShedder, ...]:
        return workers_of(self.limiters)


class Engine:
    def __init__(
        self,
        store: Store,
        policy: Policy,
        *,
        keys: Keys | None = None,
        deadline: float = STORE_DEADLINE_MS / 1000.0,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
        observer: Observer | None = None,
        salt: bytes = b"",
        breaker: Breaker | None = None,
        releaser: Releaser | None = None,
        store_check: StoreCheck | None = None,
    ) -> None:
        """Everything is given here, once: the server builds the observer (metrics, logs,
        shadow recorder, tracing) and the store-call wrapper (latency histogram, child
        span: :func:`extauthz.observe.metrics.instrument_store_check`) before the engine."""
        self.store = store
        #: the store call of a check (``store.check``, or the server's wrapper around it)
        self.store_check: StoreCheck = store_check if store_check is not None else store.check
        #: the embedded store answers within the call: no task, no deadline needed.
        self.store_immediate = store.immediate
        #: the one release path (access log, request-id index, cancelled Checks, abandoned answers)
        self.releaser = releaser or Releaser(store, timeout=max(deadline * 10, 0.05),
                                             retry_for=lambda: self.snapshot.policy.longest_lease_ttl)
        #: batched fleet grants, current and retired: releases find their slots there first
        self.fleet_slots = LocalSlots()
        self.releaser.local = self.fleet_slots.release
        self.keys = keys or Keys()
        self.deadline = deadline
        self.clock = clock
        self._rng = rng
        self.observer: Observer = observer or NullObserver()
        self._salt = salt
        self.breaker = breaker or Breaker(clock)
        #: the single-store path's breakers, built once (not per check)
        self._one_breaker: list[tuple[str, Breaker]] = [("", self.breaker)]
        #: Redis Cluster: one breaker per master (``breaker`` is their template), so that one
        #: slow master fails open only the checks that need it (names: ``store.node_of``)
        self.node_breakers: dict[str, Breaker] = {}
        self._node_of: Callable[[str], str] | None = store.node_of if store.per_master else None
        #: fail-opens/closes by reason (timeout, unavailable, circuit_open, internal_error)
        self.failures: dict[str, int] = {}
        #: deadlines passed while the store was not late (:meth:`_answer`): the check was
        #: still queued here, or its answer not carried yet by this server's busy loop, or its
        #: command written less than a deadline ago: the check waited on
        self.deadline_extended = 0
        #: batched grants of failed-open requests given back (:meth:`_return_grants`), and
        #: those give-backs that failed
        self.grant_returns = 0
        self.grant_return_errors = 0
        self._returning: set[asyncio.Task[None]] = set()
        #: passed deadlines by where the check was then (:meth:`_answer`): ``queued`` (not
        #: written to the store yet, or written less than a deadline before), ``redis``
        #: (written at least a deadline before, unanswered: the store is late), ``loop``
        #: (answered, the answer not carried to the check yet)
        self.deadline_missed: dict[str, int] = dict.fromkeys(DEADLINE_WHERE, 0)
        self._bug_log = LogThrottle(log, clock=clock)
        #: live per-customer overrides (``extauthz.overrides``), compiled into each snapshot.
        self.overrides: tuple[Override, ...] = ()
        self.snapshot = self._build(policy, Switches(), None)

    # -- configuration ------------------------------------------------------------------
    def _build(self, policy: Policy, switches: Switches, old: Snapshot | None,
               limiters: tuple[Limiter, ...] | None = None) -> Snapshot:
        if limiters is None:
            limiters = build_limiters(policy, self.keys, self._rng, self.clock)
            bind_store(limiters, self.store)  # batched grants go back to this store
            self.fleet_slots.add(limiters)
            if old is not None:  # a reload keeps each shedder's level
                keep_levels(old.workers, limiters)
        table, not_applied = compile_overrides(self.overrides, limiters, self.clock.wall(),
                                               policy.identity_labels)
        if not_applied and not_applied != (old.overrides_not_applied if old is not None else {}):
            log.warning("%d live overrides not applied", len(not_applied), extra={"fields": {
                "event": "overrides_not_applied", "count": len(not_applied),
                "not_applied": [f"{lim}/{ident}: {why}" for (lim, ident), why in
                                sorted(not_applied.items())][:50]}})
        classifier = Classifier(policy, self._salt, table)
        if old is not None:  # counts, exported: carried over to the new snapshot
            classifier.unknown_tiers = old.classifier.unknown_tiers
            classifier.unknown_plans = old.classifier.unknown_plans
        return Snapshot(policy, classifier, limiters, _active(policy, limiters, switches),
                        switches, not_applied)

    def set_policy(self, policy: Policy) -> None:
        old = self.snapshot
        self.snapshot = self._build(policy, old.switches, old)
        retire_grants(old.limiters, self.snapshot.limiters)  # old batched grants go back

    def set_switches(self, switches: Switches) -> None:
        """Apply the kill switches. They never depend on overrides: the new snapshot keeps
        the current one's classifier (with its compiled overrides) and changes only the
        effective modes, so a switch applies whatever the overrides hold."""
        old = self.snapshot
        if switches != old.switches:
            self.snapshot = replace(old, switches=switches,
                                    active=_active(old.policy, old.limiters, switches))

    def set_overrides(self, overrides: Sequence[Override]) -> None:
        """Apply the live overrides (expired ones are dropped); a reload keeps them."""
        self.overrides = tuple(overrides)
        old = self.snapshot
        self.snapshot = self._build(old.policy, old.switches, old, old.limiters)

    async def settle_grants(self) -> None:
        """A graceful stop: batched grants still held go back to the store at once (and
        those of failed-open requests on their way, :meth:`_return_grants`)."""
        await settle_grants(self.snapshot.limiters)
        while self._returning:
            await asyncio.gather(*list(self._returning), return_exceptions=True)

    # -- the request path -----------------------------------------------------------------
    def context(self, raw: RawRequest) -> RequestContext:
        return self.snapshot.classifier.context(raw)

    async def check(self, raw: RawRequest) -> tuple[RequestContext, Decision]:
        ctx = self.context(raw)
        return ctx, await self.decide(ctx)

    async def decide(self, ctx: RequestContext, left: float | None = None,
                     starved: bool = False) -> Decision:
        """The decision for ``ctx``. Never raises: a store failure, a missed deadline, an
        open breaker and any unexpected exception (a limiter or client library bug) fail
        each applicable limiter open or closed per its ``failure_mode``, counted by reason.

        Overload (``extauthz.overload``): ``left`` is the time the check has left to be
        answered in (None: unbounded); a store call that waits never outlives it, and a
        check with none left for it fails its store limiters per ``failure_mode`` with the
        reason ``overload`` (the embedded store answers within the call: decided as usual).
        While ``starved`` the shedders refuse non-critical requests at once, without the
        store (:meth:`~extauthz.limiters.base.FleetWide.overloaded`); a short ``left`` alone
        (a client's short deadline on a healthy server) sheds nothing."""
        snap = self.snapshot
        try:
            decision = await self._decide(ctx, snap, left, starved)
        except Exception as exc:
            decision = self._internal_error(ctx, snap, exc)
        self.observer.decided(ctx, decision, snap.policy)
        return decision

    async def _decide(self, ctx: RequestContext, snap: Snapshot, left: float | None = None,
                      starved: bool = False) -> Decision:
        refused: Verdict | None = None
        # One slot per applicable limiter, in policy order: its local verdict (if it
        # decided locally) and the index of its store op (or -1).
        slots: list[tuple[Limiter, bool, Verdict | None, int]] = []
        ops: list[Op] = []
        skipped: list[str] = []
        for lim, enforce in snap.active:
            if not applies(lim.applies_to, ctx):
                continue
            if lim.key_missing(ctx):
                skipped.append(lim.name)
                continue
            # starved: an enforcing shedder refuses non-critical requests without the store
            shed = lim.overloaded(ctx, enforce) if starved and enforce and isinstance(lim, FleetWide) else None
            local = lim.local(ctx, enforce) if shed is None else shed
            if local is not None and refused is None and local.refused:
                refused = local
            op = lim.op(ctx, enforce) if shed is None else None
            if op is not None:
                ops.append(op)
            slots.append((lim, enforce, local, len(ops) - 1 if op is not None else -1))

        verdicts: list[Verdict] = []
        failures: tuple[str, ...] = ()
        held: list[str] = []
        lease_id = ""
        if refused is not None or not ops:
            # Nothing to ask the store, or a local shedder refused: nothing is committed.
            verdicts = [local for _, _, local, _ in slots if local is not None]
        else:
            lease_id = os.urandom(8).hex()
            try:
                result = await self._store_check_within(ops, lease_id, left)
            except StoreError as exc:
                failures = (exc.reason,)
                for lim, _, local, _ in slots:
                    v = local if local is not None else failed_verdict(lim, f"store_{exc.reason}")
                    verdicts.append(v)
                    if v.refused and refused is None:
                        refused = v
            else:
                try:
                    for lim, enforce, local, i in slots:
                        res = result.results[i] if i >= 0 else None
                        if local is not None:
                            v = local
                        else:
                            assert res is not None
                            v = lim.verdict(ctx, res, enforce)
                        verdicts.append(v)
                        if v.refused and refused is None:
                            refused = v
                        if res is not None and result.admitted and res.allowed:
                            op = ops[i]
                            if isinstance(op, LeaseOp):
                                held.append(op.key)
                except Exception:
                    # The store committed: give its leases back before failing the request.
                    taken = [op.key for op, res in zip(ops, result.results, strict=False)
                             if result.admitted and res.allowed and isinstance(op, LeaseOp)]
                    self.releaser.release(taken, lease_id, "abandoned_answer")
                    raise
        if refused is not None:
            refund_grants(ctx, slots)
        if self.fleet_slots.tables:  # slots taken from local fleet grants (batched)
            if not lease_id:
                lease_id = os.urandom(8).hex()
            held.extend(hold_leases(ctx, slots, lease_id, refused is None))
        lease_keys = tuple(held)
        if not lease_keys:
            lease_id = ""
        return Decision(
            allowed=refused is None,
            tier=ctx.tier,
            verdicts=tuple(verdicts),
            denied_by=refused,
            leases=lease_keys,
            lease_id=lease_id,
            failures=failures,
            skipped=tuple(skipped),
        )

    def _internal_error(self, ctx: RequestContext, snap: Snapshot, exc: Exception) -> Decision:
        """An unexpected exception while deciding: every applicable limiter fails open or
        closed per its ``failure_mode``; counted (``internal_error``) and logged, rate-limited."""
        self._failed(INTERNAL_ERROR)
        self._bug_log.log(logging.ERROR, "unexpected error while deciding; failing per "
                          "failure_mode: %s: %s", type(exc).__name__, exc, exc_info=exc,
                          fields={"event": "internal_error", "error": type(exc).__name__})
        verdicts: list[Verdict] = []
        refused: Verdict | None = None
        for lim, _ in snap.active:
            try:
                applicable = applies(lim.applies_to, ctx) and not lim.key_missing(ctx)
            except Exception:
                applicable = True
            if applicable:
                v = failed_verdict(lim, INTERNAL_ERROR)
                verdicts.append(v)
                if v.refused and refused is None:
                    refused = v
        return Decision(allowed=refused is None, tier=ctx.tier, verdicts=tuple(verdicts),
                        denied_by=refused, failures=(INTERNAL_ERROR,))

    async def _store_check_within(self, ops: Sequence[Op], lease_id: str,
                                  left: float | None) -> CheckResult:
        """The store call, never outliving the check's time ``left`` (the embedded store
        answers within the call: nothing to bound): with none left it is not made; when
        ``left`` runs out first the call goes on (a late answer's leases go back, as for a
        cancelled Check) and the check fails with ``overload``, not counted against the
        store's breaker (the store is not the one late)."""
        if left is None or self.store_immediate or left >= self.deadline * (LOOP_EXTENSIONS + 1):
            return await self._store_check(ops, lease_id)  # the store deadline comes first
        if left > 0:
            try:
                async with asyncio.timeout(left):
                    return await self._store_check(ops, lease_id)
            except TimeoutError:
                pass
        self._failed(Overloaded.reason)
        raise Overloaded(f"no time left for the store call ({left * 1000:.0f} ms of the check budget)")

    def _breakers(self, ops: Sequence[Op]) -> list[tuple[str, Breaker]]:
        """The breakers a check of ``ops`` goes through: the store's, or on Redis Cluster the
        breaker of each master holding one of the keys."""
        if self._node_of is None:
            return self._one_breaker
        out = []
        by_tag = {Keys.tag_of(op.key): op.key for op in ops}  # one slot per hash tag
        for name in {self._node_of(key) for key in by_tag.values()}:
            breaker = self.node_breakers.get(name)
            if breaker is None:
                breaker = self.node_breakers[name] = self.breaker.like()
            out.append((name, breaker))
        return out

    @property
    def breaker_state(self) -> str:
        """``open`` when any breaker skips the store (a Cluster master's counts), else the
        state of the most open one."""
        states = {b.state for b in (self.breaker, *self.node_breakers.values())}
        return next((s for s in ("open", "half_open") if s in states), "closed")

    def _blame(self, breakers: list[tuple[str, Breaker]], blamed: set[str]) -> None:
        """A failed store call: a failure on the breakers of the ``blamed`` masters (all of
        them when none is named); the others answered (or are answering in time)."""
        for name, breaker in breakers:
            if not blamed or name in blamed:
                breaker.failure()
            else:
                breaker.success()

    async def _store_check(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        breakers = self._breakers(ops)
        if len(breakers) == 1:  # one store (or one master): no list walk on the hot path
            allowed = breakers[0][1].allow()
        elif allowed := all(breaker.would_allow() for _, breaker in breakers):
            for _, breaker in breakers:
                breaker.allow()  # takes the half-open probe where there is one
        if not allowed:
            self._failed(CircuitOpen.reason)
            self._return_grants(ops, None)  # never sent: what the grant ops lent goes back
            raise CircuitOpen("circuit open")
        if self.store_immediate:  # the embedded store answers synchronously: no deadline
            try:
                return await self.store_check(ops, lease_id)
            except Exception as exc:
                if (failure := self._store_failed(exc, breakers)) is exc:
                    raise
                raise failure from exc
        # The store call runs as its own task, shielded: when the deadline passes (or
        # Envoy cancels the Check) the call may still commit. asyncio can even wake us
        # with TimeoutError after the answer arrived. Either way the answer is not lost:
        # leases it took are given back as soon as it lands (no leak until lease_ttl).
        call = asyncio.ensure_future(self.store_check(ops, lease_id))
        try:
            result = await self._answer(call, lease_id)
        except StoreLate as late:
            if call.done() and not call.cancelled() and call.exception() is None:
                # the answer landed in the same loop turn as the deadline: it is in time
                for _, breaker in breakers:
                    breaker.success()
                return call.result()
            self._abandoned(call, ops, lease_id)
            if late.masters is not None:  # the store was late: its breakers count it
                self._blame(breakers, set() if len(breakers) == 1 else set(late.masters))
            else:  # late in this server (queued, loop): no outcome, but a probe is given up
                for _, breaker in breakers:
                    breaker.abandon()
            self._failed(StoreTimeout.reason)
            raise StoreTimeout(f"store did not answer within {self.deadline * 1000:.0f} ms") from None
        except Exception as exc:
            if isinstance(exc, StoreError) and exc.late is not None:
                # sent but unanswered: a stalled store may still commit it
                self._abandoned(call, ops, lease_id)
            else:  # nothing committed: what the grant ops lent goes back
                self._return_grants(ops, None)
            if (failure := self._store_failed(exc, breakers)) is exc:
                raise
            raise failure from exc
        except asyncio.CancelledError:
            self._abandoned(call, ops, lease_id)
            for _, breaker in breakers:
                breaker.abandon()  # a half-open probe given up: the next call probes
            raise
        for _, breaker in breakers:
            breaker.success()
        return result

    def _abandoned(self, call: asyncio.Future[CheckResult], ops: Sequence[Op], lease_id: str) -> None:
        """Nobody waits for ``call`` any more: when it lands, the leases it committed go back
        (the Releaser) and so do the batched grants it took (:meth:`_return_grants`)."""
        call.add_done_callback(self.releaser.abandoned(ops, lease_id))
        if any(isinstance(op, GrantOp) for op in ops):
            call.add_done_callback(self._grants_landed(ops))

    def _grants_landed(self, ops: Sequence[Op]) -> Callable[[asyncio.Future[CheckResult]], None]:
        """A done callback for an abandoned call with batched grant ops: once its answer is
        known (a late one followed, as the Releaser does), the grants it took go back."""
        def landed(call: asyncio.Future[CheckResult]) -> None:
            if call.cancelled():
                return
            error = call.exception()
            if isinstance(error, StoreError) and error.late is not None:
                error.late.add_done_callback(landed)  # sent, unanswered: its answer may still come
            elif error is None:
                self._return_grants(ops, call.result())
            else:
                self._return_grants(ops, None)  # failed unsent: nothing committed

        return landed

    def _return_grants(self, ops: Sequence[Op], result: CheckResult | None) -> None:
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
                amount = op.held if self._node_of is None else 0.0  # a cluster group may have run
            else:
                res = result.results[i]
                amount = res.extra - op.cost if result.admitted and res.allowed and res.extra > 0 else 0.0
            if amount > 0.0:
                back.append(ReturnOp(op.key, op.rate, op.burst, amount))
        if back:
            self.grant_returns += len(back)
            task = asyncio.get_running_loop().create_task(self._send_returns(back))
            self._returning.add(task)
            task.add_done_callback(self._returning.discard)

    async def _send_returns(self, ops: list[Op]) -> None:
        try:
            await self.store.check(ops, "")
        except Exception:  # a lost give-back only refuses early (counted, never raised)
            self.grant_return_errors += len(ops)

    def _store_failed(self, exc: Exception, breakers: list[tuple[str, Breaker]]) -> StoreError:
        """A failed store call: counted (by reason) on the breakers (of the masters whose
        part failed, when the store names them) and here. A client library bug (not a
        StoreError) is an ``internal_error``, logged rate-limited."""
        keys = exc.keys if isinstance(exc, StoreError) and self._node_of is not None else ()
        self._blame(breakers, {self._node_of(key) for key in keys} if self._node_of else set())
        if isinstance(exc, StoreError):
            self._failed(exc.reason)
            return exc
        self._failed(INTERNAL_ERROR)
        self._bug_log.log(logging.ERROR, "unexpected error from the store call; failing per "
                          "failure_mode: %s: %s", type(exc).__name__, exc, exc_info=exc,
                          fields={"event": "internal_error", "error": type(exc).__name__})
        return StoreInternalError(f"{type(exc).__name__}: {exc}")

    async def _answer(self, call: asyncio.Future[CheckResult], lease_id: str) -> CheckResult:
        """``call``'s answer, or :class:`StoreLate` when it does not come in time.

        The deadline is measured against the store: from when the check's command was
        written, until its reply was read. When it passes, the engine lets the loop read its
        sockets once (one I/O poll) and asks the store where the check is
        (:meth:`Store.waiting`), counting each pass by where the time went
        (``deadline_missed``):

        * ``redis``: a part written at least a deadline ago and still unanswered: the store
          is late; the check fails open and the breakers of those masters count it;
        * ``queued``: not written yet (this server's batcher and loop), or ``loop``: answered,
          the answer not yet carried to the check by this server's busy loop: the check
          waits on (counted ``deadline_extended``), for the rest of the deadline of a part
          written meanwhile. After :data:`LOOP_EXTENSIONS` such passes it fails open all the
          same (``timeout``) but no breaker counts it: Redis was not the one that was late.

        A store that cannot tell (None) fails open at the deadline."""
        wait = self.deadline
        passes = 0
        while True:
            try:
                async with asyncio.timeout(wait):
                    return await asyncio.shield(call)
            except TimeoutError:
                if call.done():  # the answer landed in the same loop turn: it is in time
                    return call.result()
                await asyncio.sleep(0)  # one I/O poll: replies already in the socket are read
                if call.done():
                    return call.result()
                parts = self.store.waiting(lease_id)
                if parts is None:
                    self._missed("redis")
                    raise StoreLate(()) from None
                late = [name for name, waited in parts if waited is not None and waited >= self.deadline]
                if late:
                    self._missed("redis")
                    raise StoreLate(late) from None
                # not late against the store: written less than a deadline ago (the time
                # before the write was spent queued here), or answered already
                self._missed("queued" if parts else "loop")
                if passes == LOOP_EXTENSIONS:
                    raise StoreLate(None) from None
                passes += 1
                self.deadline_extended += 1
                written = [waited for _, waited in parts if waited is not None]
                # the rest of the deadline of the oldest part written (at least a tenth of it)
                wait = max(self.deadline / 10, self.deadline - max(written, default=0.0))

    def _missed(self, where: str) -> None:
        """A passed deadline, by where the check was then (:meth:`_answer`)."""
        self.deadline_missed[where] += 1

    def _failed(self, reason: str) -> None:
        """The one failure count: ``extauthz_fail_open_total{reason}`` (each failure fails
        its limiters open or closed per ``failure_mode``)."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
