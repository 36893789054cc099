"""The one check flow, whatever the transport: request in, decision, lease bookkeeping,
answer (and, with tracing on, the span around them).

Each front door is an adapter (:class:`Door`) that only translates its wire format: the gRPC
servicer (``server/services.py``, CheckRequest -> CheckResponse) and the HTTP authorization
port (``server/http.py`` with ``server/httpmap.py``, an HTTP/1.1 request -> an HTTP answer).
:meth:`CheckFlow.check` runs the same steps for both (opa-envoy-plugin's ``envoyauth/`` under
its gRPC and HTTP servers is the model):

1. the door reads its message into a :class:`~extauthz.core.context.RawRequest`, which the
   policy's classifier turns into a request context; a request the door cannot read is
   allowed and counted here (``extauthz_bad_requests_total``), never an error;
2. the engine decides (it never raises; fail-open is decided there) within the time the
   check has left (:class:`~extauthz.engine.overload.LoopLag`: the check budget less what the door
   saw it wait), and knowing whether the server is starved (its loop lags): then the
   shedders refuse non-critical requests at once instead of Envoy timing the check out;
3. an admitted decision's leases go to the lease owner (:class:`~extauthz.server.leases.Leases`):
   remembered by request id with the ticket the answer carries, or given back at once when
   the door says its answer can no longer reach Envoy;
4. the door builds its answer from the same pieces (:mod:`extauthz.engine.answers`).

With metrics on, the time from 1 to 4 of a decided check is counted by door and decision
(``extauthz_check_duration_seconds``, :class:`~extauthz.observe.metrics.CheckDurations`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..core.context import RawRequest, RequestContext
from ..core.throttle import LogThrottle
from ..core.verdict import Decision
from ..engine.engine import Engine, Snapshot
from ..engine.overload import LoopLag
from .leases import Leases

if TYPE_CHECKING:
    from ..observe.metrics import CheckDurations

__all__ = ["CheckFlow", "Door"]

log = logging.getLogger("extauthz.server")

M = TypeVar("M", contravariant=True)  # what the door receives (a CheckRequest, an HTTP request)
C = TypeVar("C", contravariant=True)  # the call it arrived on (a gRPC context, a connection)
A = TypeVar("A", covariant=True)  # what the door answers (a CheckResponse, HTTP bytes)


class Door(Protocol[M, C, A]):
    """A front door's wire format: everything :meth:`CheckFlow.check` asks of a transport."""

    @property
    def name(self) -> str:
        """The door's ``door`` label (``grpc``, ``http``: :data:`~extauthz.observe.metrics.DOORS`)."""

    @property
    def what(self) -> str:
        """A request of this door, as the bad-request log names it ("a CheckRequest")."""

    @property
    def span(self) -> Mapping[str, str]:
        """The check span's attributes (tracing on)."""

    def read(self, message: M, snap: Snapshot) -> RawRequest:
        """The request as the engine sees it (may raise: the request is then allowed, counted)."""

    def hold(self, message: M, call: C, ctx: RequestContext, decision: Decision,
             leases: Leases) -> str | None:
        """An answer with leases is on its way: None when it can no longer reach Envoy (the
        call is gone); else what identifies the request to the request-id index
        (``leases.seen_at``/``seen_as``), having arranged for ``leases.abandoned(decision)``
        should Envoy drop the answer later (a reset call)."""

    def answer(self, message: M, ctx: RequestContext, decision: Decision, ticket: str) -> A:
        """The answer to a decided request (``ticket``: the lease ticket, "" when none)."""

    def time_left(self, message: M, call: C) -> tuple[float | None, float, bool]:
        """What the door knows of the check's time: the call's own time left (None when the
        call carries no deadline; :class:`~extauthz.engine.overload.LoopLag` takes Envoy's margin
        off it), how long the check has waited since the door received it, and whether the
        deadline was stamped on the call's arrival, before the event loop read it
        (:meth:`~extauthz.engine.overload.LoopLag.check`)."""

    def unreadable(self, message: M) -> A:
        """The answer to a request the door could not read: allowed."""

    def carrier(self, message: M, call: C) -> Iterable[tuple[str, Any]]:
        """The ``traceparent``/``tracestate`` pairs the request carries (tracing on)."""


class CheckFlow:
    """The check flow of one server (module docstring), shared by both front doors."""

    def __init__(self, engine: Engine, leases: Leases, lag: LoopLag | None = None,
                 durations: CheckDurations | None = None) -> None:
        self.engine = engine
        self.leases = leases
        #: the loop's lag and the check budget (None: checks are not timed)
        self.lag = lag
        #: ``extauthz_check_duration_seconds`` (None: metrics off, no clock read)
        self.durations = durations
        #: requests a door could not read (answered allowed): ``extauthz_bad_requests_total``
        self.bad_requests = 0
        self._bad_log = LogThrottle(log)

    async def check(self, door: Door[M, C, A], message: M, call: C) -> A:
        durations = self.durations
        t0 = perf_counter() if durations is not None else 0.0
        snap = self.engine.snapshot
        try:
            ctx = snap.classifier.context(door.read(message, snap))
        except Exception as exc:  # a request the door cannot read: allowed, counted here
            self.bad_request(door.what, exc)
            return door.unreadable(message)
        # Never raises (failures are decided by failure_mode and counted in the engine). A
        # cancellation while the store call is out is handled there too (the answer's
        # leases are given back when it lands).
        lag = self.lag
        if lag is None:
            decision = await self.engine.decide(ctx)
        else:
            left, starved = lag.check(*door.time_left(message, call))
            if starved:
                lag.overloaded[ctx.tier.value] = lag.overloaded.get(ctx.tier.value, 0) + 1
            decision = await self.engine.decide(ctx, left, starved)
        ticket = ""
        if decision.leases:
            leases = self.leases
            seen = door.hold(message, call, ctx, decision, leases)
            if seen is not None:
                ticket = leases.admitted(ctx, decision, seen)
            else:
                leases.abandoned(decision)  # Envoy gave up on this check: the answer is lost
        answer = door.answer(message, ctx, decision, ticket)
        if durations is not None:
            durations.observe(door.name, decision, perf_counter() - t0)
        return answer

    def bad_request(self, what: str, exc: Exception) -> None:
        """Count (and log, throttled) a request a door could not read; it was allowed."""
        self.bad_requests += 1
        self._bad_log.log(logging.WARNING, "could not read %s; allowing it: %s: %s", what,
                          type(exc).__name__, exc, fields={"event": "bad_request"})
