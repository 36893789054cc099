"""The engine: classify, run every applicable limiter, decide. No grpc here.

This module is the one place that decides fail-open: a store error, a missed deadline, an
open circuit breaker or an unexpected exception (``internal_error``) becomes an allowed
verdict (``failed_open``) for limiters with ``failure_mode: open`` and a 503
(``failed_closed``) for those with ``failure_mode: closed``, counted by reason
(:attr:`Engine.failures`, exported as ``extauthz_fail_open_total{reason}``).
The store call goes through the :class:`~extauthz.engine.storegate.StoreGate` (breakers, deadline,
abandoned answers); batched grants through its :class:`~extauthz.limiters.grants.GrantBook`
(``Engine.grants``); leases go back through its :class:`~extauthz.engine.release.Releaser`
(``Engine.releaser``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..control.overrides import Override, compile_overrides
from ..control.switches import Switches
from ..core.context import RawRequest, RequestContext
from ..core.errors import INTERNAL_ERROR, Overloaded, StoreError, StoreInternalError
from ..core.throttle import LogThrottle
from ..core.verdict import Decision, Mode, Outcome, Verdict
from ..limiters import Limiter, WorkerUtilizationShedder, build_limiters
from ..limiters.base import FleetWide, applies
from ..limiters.worker import keep_levels, workers_of
from ..observe.base import NullObserver, Observer
from ..policy.classify import Classifier
from ..policy.model import Policy
from ..store.base import CheckResult, LeaseOp, Op
from ..store.keys import Keys
from .storegate import StoreGate

log = logging.getLogger("extauthz.engine")


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
        gate: StoreGate,
        policy: Policy,
        *,
        keys: Keys | None = None,
        rng: random.Random | None = None,
        observer: Observer | None = None,
        salt: bytes = b"",
    ) -> None:
        """Everything is given here, once: the server builds the store gate (its deadline,
        breaker, clock and store-call wrapper: latency histogram, child span,
        :func:`extauthz.observe.metrics.instrument_store_check`) and the observer (metrics,
        logs, shadow recorder, tracing) before the engine. One gate per engine: its grant
        book follows this engine's snapshots (ValueError for a gate already serving one)."""
        if gate.grants.adopted:
            raise ValueError("this StoreGate already serves an engine (its grant book follows one "
                             "engine's limiters): build a StoreGate per engine")
        #: the store call of a check, behind its breakers and deadline
        self.gate = gate
        self.store = gate.store
        self.clock = gate.clock
        #: batched grants: refunds, local leases, retire, settle, status
        self.grants = gate.grants
        #: the one release path (access log, request-id index, cancelled Checks, abandoned answers)
        self.releaser = gate.releaser
        self.keys = keys or Keys()
        self._rng = rng
        self.observer: Observer = observer or NullObserver()
        self._salt = salt
        #: fail-opens/closes by reason (timeout, unavailable, circuit_open, internal_error)
        self.failures: dict[str, int] = {}
        self._bug_log = LogThrottle(log, clock=self.clock)
        #: live per-customer overrides (``extauthz.control.overrides``), compiled into each snapshot.
        self.overrides: tuple[Override, ...] = ()
        self.snapshot = self._build(policy, Switches(), None)
        self.grants.adopt(self.snapshot.limiters, policy.longest_lease_ttl)

    # -- configuration ------------------------------------------------------------------
    def _build(self, policy: Policy, switches: Switches, old: Snapshot | None,
               limiters: tuple[Limiter, ...] | None = None) -> Snapshot:
        if limiters is None:
            limiters = build_limiters(policy, self.keys, self._rng, self.clock, self.store)
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
        self.grants.adopt(self.snapshot.limiters, policy.longest_lease_ttl)  # old batched grants go back

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
        those of failed-open requests on their way: :meth:`GrantBook.settle`)."""
        await self.grants.settle()

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

        Overload (``extauthz.engine.overload``): ``left`` is the time the check has left to be
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
            lease_id = ctx.lease_id or os.urandom(8).hex()
            try:
                result = await self._store_check_within(ops, lease_id, left)
            except StoreError as exc:
                self._failed(exc.reason)
                if isinstance(exc, StoreInternalError) and (bug := exc.__cause__) is not None:
                    self._bug_log.log(logging.ERROR, "unexpected error from the store call; failing per "
                                      "failure_mode: %s: %s", type(bug).__name__, bug, exc_info=bug,
                                      fields={"event": "internal_error", "error": type(bug).__name__})
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
            self.grants.refund(ctx, slots)
        if self.grants.holds_leases:  # slots taken from local fleet grants (batched)
            if not lease_id:
                lease_id = ctx.lease_id or os.urandom(8).hex()
            held.extend(self.grants.hold(ctx, slots, lease_id, refused is None))
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
        """The store call (:meth:`StoreGate.call`), never outliving the check's time ``left``
        (the embedded store answers within the call: nothing to bound): with none left it is
        not made; when ``left`` runs out first the call goes on (a late answer's leases go
        back, as for a cancelled Check) and the check fails with ``overload``, not counted
        against the store's breaker (the store is not the one late)."""
        gate = self.gate
        if left is None or gate.immediate or left >= gate.longest:
            return await gate.call(ops, lease_id)  # the store deadline comes first
        if left > 0:
            try:
                async with asyncio.timeout(left):
                    return await gate.call(ops, lease_id)
            except TimeoutError:
                pass
        raise Overloaded(f"no time left for the store call ({left * 1000:.0f} ms of the check budget)")

    def _failed(self, reason: str) -> None:
        """The one failure count: ``extauthz_fail_open_total{reason}`` (each failure fails
        its limiters open or closed per ``failure_mode``)."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
