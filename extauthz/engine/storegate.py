"""The store gate: a check's one store call, protected.

:class:`StoreGate` owns what stands between a check and its store: the circuit breakers
(one per Redis Cluster master), which of them a failure blames, the store deadline and its
extension while the store is not the one late (:meth:`Store.waiting`), and an abandoned
answer (a passed deadline, a cancelled Check, a call sent but unanswered): the leases it
commits go back through the :class:`~extauthz.engine.release.Releaser`, the batched grants it takes
through the :class:`~extauthz.limiters.grants.GrantBook`.

It raises a :class:`~extauthz.core.errors.StoreError` and decides nothing: the engine decides
fail-open and counts every failure once (:meth:`extauthz.engine.engine.Engine.decide`). It lives
beside the engine, not in ``store/``: it builds on the breaker, the releaser and the grant
book, which sit above the stores.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.errors import CircuitOpen, StoreError, StoreInternalError, StoreTimeout
from ..core.settings import STORE_DEADLINE_MS
from ..limiters.grants import GrantBook
from ..store.base import CheckResult, GrantOp, Op, Store
from ..store.keys import Keys
from .breaker import Breaker
from .release import Releaser

#: times a check's store deadline may be given again when the store is not late: the check
#: still queued in this server, or its answer not yet carried by the server's own busy loop
#: (:meth:`StoreGate._answer`): a bound (each pass at most one deadline: 100 ms at the
#: default 5 ms, below Envoy's 250 ms; what bounds a starved server's answers is its overload
#: budget, not the store deadline). 3 failed open a third of a loaded cluster's checks whose
#: answers Redis had given in time (issue 29).
LOOP_EXTENSIONS = 20
#: where a check was when its store deadline passed (``extauthz_store_deadline_missed_total``)
DEADLINE_WHERE: Final = ("queued", "redis", "loop")

#: the store call of a check: ``Store.check`` or a wrapper around it
StoreCheck = Callable[[Sequence[Op], str], Awaitable[CheckResult]]


class StoreLate(TimeoutError):
    """A check's store deadline passed (:meth:`StoreGate._answer`): ``masters`` the store's
    masters that were late (``()``: the store, unnamed), or None when the store was not the
    one that was late (no breaker counts it)."""

    def __init__(self, masters: Sequence[str] | None) -> None:
        super().__init__("store deadline")
        self.masters = masters


class StoreGate:
    """A check's store call (:meth:`call`) behind its breakers and deadline; built with its
    store, once, and everything it gives back goes to that store."""

    def __init__(self, store: Store, deadline: float = STORE_DEADLINE_MS / 1000.0,
                 breaker: Breaker | None = None, *, clock: Clock = SYSTEM_CLOCK,
                 store_check: StoreCheck | None = None) -> None:
        """``store_check``: the server's wrapper around ``store.check`` (latency histogram,
        child span: :func:`extauthz.observe.metrics.instrument_store_check`)."""
        self.store = store
        self.deadline = deadline
        self.clock = clock
        #: the store call of a check (``store.check``, or the server's wrapper around it)
        self.store_check: StoreCheck = store_check if store_check is not None else store.check
        #: the embedded store answers within the call: no task, no deadline needed.
        self.immediate = store.immediate
        #: batched grants: where lent and abandoned grants go back, and local fleet slots
        self.grants = GrantBook(store)
        #: the one release path (access log, request-id index, cancelled Checks, abandoned answers)
        self.releaser = Releaser(store, timeout=max(deadline * 10, 0.05), retry_for=self.grants.retry_for,
                                 local=self.grants.release)
        self.breaker = breaker or Breaker(clock)
        #: the single-store path's breakers, built once (not per check)
        self._one_breaker: list[tuple[str, Breaker]] = [("", self.breaker)]
        #: Redis Cluster: one breaker per master (``breaker`` is their template), so that one
        #: slow master fails open only the checks that need it (names: ``store.node_of``)
        self.node_breakers: dict[str, Breaker] = {}
        self._node_of: Callable[[str], str] | None = store.node_of if store.per_master else None
        #: deadlines passed while the store was not late (:meth:`_answer`): the check was
        #: still queued here, or its answer not carried yet by this server's busy loop, or its
        #: command written less than a deadline ago: the check waited on
        self.deadline_extended = 0
        #: passed deadlines by where the check was then (:meth:`_answer`): ``queued`` (not
        #: written to the store yet, or written less than a deadline before), ``redis``
        #: (written at least a deadline before, unanswered: the store is late), ``loop``
        #: (answered, the answer not carried to the check yet)
        self.deadline_missed: dict[str, int] = dict.fromkeys(DEADLINE_WHERE, 0)

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
    def longest(self) -> float:
        """The longest :meth:`call` waits for an answer: its deadline, given again at most
        :data:`LOOP_EXTENSIONS` times while the store is not the one late."""
        return self.deadline * (LOOP_EXTENSIONS + 1)

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

    async def call(self, ops: Sequence[Op], lease_id: str) -> CheckResult:
        """The store's answer to ``ops`` (their leases named ``lease_id``), or a
        :class:`~extauthz.core.errors.StoreError`: :class:`~extauthz.core.errors.CircuitOpen` (not
        sent), :class:`~extauthz.core.errors.StoreTimeout` (the deadline passed: the answer, when
        it lands, gives back what it took), the store's own error, or
        :class:`~extauthz.core.errors.StoreInternalError` from a client library bug (its
        ``__cause__``)."""
        breakers = self._breakers(ops)
        if len(breakers) == 1:  # one store (or one master): no list walk on the hot path
            allowed = breakers[0][1].allow()
        elif allowed := all(breaker.would_allow() for _, breaker in breakers):
            for _, breaker in breakers:
                breaker.allow()  # takes the half-open probe where there is one
        if not allowed:
            self.grants.give_back(ops, None)  # never sent: what the grant ops lent goes back
            raise CircuitOpen("circuit open")
        if self.immediate:  # the embedded store answers synchronously: no deadline
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
            raise StoreTimeout(f"store did not answer within {self.deadline * 1000:.0f} ms") from None
        except Exception as exc:
            if isinstance(exc, StoreError) and exc.late is not None:
                # sent but unanswered: a stalled store may still commit it
                self._abandoned(call, ops, lease_id)
            else:  # nothing committed: what the grant ops lent goes back
                self.grants.give_back(ops, None)
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
        (the Releaser) and so do the batched grants it took (:meth:`GrantBook.give_back`)."""
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
                self.grants.give_back(ops, call.result())
            else:
                self.grants.give_back(ops, None)  # failed unsent: nothing committed

        return landed

    def _store_failed(self, exc: Exception, breakers: list[tuple[str, Breaker]]) -> StoreError:
        """A failed store call: counted on the breakers (of the masters whose part failed,
        when the store names them). A client library bug (not a StoreError) becomes a
        :class:`~extauthz.core.errors.StoreInternalError` raised from it (the engine logs it)."""
        keys = exc.keys if isinstance(exc, StoreError) and self._node_of is not None else ()
        self._blame(breakers, {self._node_of(key) for key in keys} if self._node_of else set())
        if isinstance(exc, StoreError):
            return exc
        return StoreInternalError(f"{type(exc).__name__}: {exc}")

    async def _answer(self, call: asyncio.Future[CheckResult], lease_id: str) -> CheckResult:
        """``call``'s answer, or :class:`StoreLate` when it does not come in time.

        The deadline is measured against the store: from when the check's command was
        written, until its reply was read. When it passes, the gate lets the loop read its
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
