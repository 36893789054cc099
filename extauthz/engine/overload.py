"""Overload: how late the server's event loop runs, and how long a check has left.

Envoy's ext_authz filter waits its ``timeout`` for an answer and then, with
``failure_mode_allow``, lets the request through unchecked: no limiter counted it and it holds
no lease, so a fleet_usage count never sees it. A starved server (its CPU taken by other work,
its loop stalled) must therefore decide before Envoy gives up, from what it holds, rather than
be timed out. Two figures tell it how things stand:

* **The loop's lag** (:class:`LoopLag`, a Runner job every :data:`LAG_INTERVAL`): how much
  later than asked the sampler's sleep ended (scheduling delay), and, read by a check, how long
  ago the sampler last ran beyond its interval, so that the checks queued behind a stall see
  it before the sampler runs again. The server is *starved* while the lag is at least
  :attr:`LoopLag.threshold` (half the check budget: 100 ms by default, past which the two or
  three loop turns a check takes no longer fit in Envoy's timeout), and after a sample that
  was, for as long again as that lag (at most one budget): the checks that queued during a
  stall cannot be told from fresh ones (a stopped process stamps nothing), and the backlog a
  stall leaves drains in about as long as it lasted. So on the HTTP port, and on the gRPC
  port served on the event loop (it stamps a call's deadline when the loop reads it). On
  the gRPC port served by grpc.aio only the part of the lag the process did not run through
  counts (the lag less the CPU time it used meanwhile: stopped, or its CPU taken): gRPC's
  own threads stamp a call's deadline when it arrives, through a stall of the loop alone (a
  garbage collection), so the deadline saw that stall; a call that arrived while the process
  was stopped is stamped when it runs again, its whole timeout left.
* **A check's time left** (:meth:`LoopLag.left`): the check budget (``serve
  --check-budget-ms``, 200 ms by default) less what the door saw the check wait: on the gRPC
  port no more than the call's deadline less Envoy's :func:`margin` (Envoy sends its timeout as
  ``grpc-timeout``; the budget plus :data:`~extauthz.core.settings.ENVOY_MARGIN_MS` as
  ``envoy-config`` renders it; a shorter deadline is logged, throttled), on the HTTP port
  the time since the request's bytes arrived (queue time behind ``--http-max-active-checks``
  included; what the loop's lag delayed before it read them is not seen there).

The engine (:meth:`extauthz.engine.engine.Engine.decide`) acts on both: while the server is starved
the shedders refuse non-critical tiers at once (never critical); a short deadline alone sheds
nothing. A store call that waits (Redis) never outlives the time left, and a check with none
left for it (or whose store call runs out of it) fails its per-customer limiters per
``failure_mode``, counted with the reason ``overload``
(``extauthz_fail_open_total{reason="overload"}``). docs/limiters.md, "A starved server".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.settings import ENVOY_MARGIN_MS
from ..core.throttle import LogThrottle

__all__ = ["LAG_INTERVAL", "LoopLag", "margin"]

log = logging.getLogger("extauthz.overload")

#: the lag sampler's period (s): a starved loop is seen within a few of them
LAG_INTERVAL: Final = 0.025
#: a call whose deadline is shorter than the check budget is logged at most this often (s)
SHORT_TIMEOUT_LOG_INTERVAL: Final = 600.0


def margin(remaining: float) -> float:
    """What a check keeps of its call's time ``remaining`` for the way back to Envoy (s):
    :data:`~extauthz.core.settings.ENVOY_MARGIN_MS`, or a quarter of a shorter deadline, so that
    a short but sufficient deadline (a client's 30 ms) is not all margin."""
    return min(ENVOY_MARGIN_MS / 1000.0, max(remaining, 0.0) / 4)


class LoopLag:
    """The event loop's lag and the overload state of one server process (module docstring).

    ``budget``: seconds a check may take from its arrival to its answer. ``running``: whether
    the sampler job runs (a stopped sampler, as in a graceful stop, reads as no lag). ``cpu``:
    the process's CPU time (s), to tell a stall the process ran through from one it did not."""

    def __init__(self, budget: float, *, clock: Clock = SYSTEM_CLOCK, interval: float = LAG_INTERVAL,
                 running: Callable[[], bool] = lambda: True,
                 cpu: Callable[[], float] = time.process_time) -> None:
        self.budget = budget
        #: the lag from which the server counts as starved
        self.threshold = budget / 2
        self.interval = interval
        self._clock = clock
        self._running = running
        self._cpu = cpu
        #: when the sampler last ran (None: not yet), and the process's CPU time then
        self._beat: float | None = None
        self._cpu_beat = 0.0
        #: the lag the sampler measured last, and the largest since the server started
        self.last = 0.0
        self.peak = 0.0
        #: the part of the last sample's lag the process did not run through (stopped, or its
        #: CPU taken): gRPC's own threads stamped no deadline then either
        self.unseen = 0.0
        #: until when a late sample keeps the server starved: for every check, and for the
        #: checks whose call has a deadline (gRPC)
        self._starved_until = -math.inf
        self._stopped_until = -math.inf
        #: checks that found the server starved, by tier
        self.overloaded: dict[str, int] = {}
        self._short_log = LogThrottle(log, clock=clock, interval=SHORT_TIMEOUT_LOG_INTERVAL)

    def tick(self) -> None:
        """The sampler's tick (a Runner job every :attr:`interval`): the lag of this wake-up."""
        now = self._clock.monotonic()
        cpu = self._cpu()
        if self._beat is not None:
            self.last = max(0.0, now - self._beat - self.interval)
            self.peak = max(self.peak, self.last)
            self.unseen = 0.0
            if self.last >= self.threshold:
                self._starved_until = now + min(self.last, self.budget)
                self.unseen = max(0.0, self.last - (cpu - self._cpu_beat))
                if self.unseen >= self.threshold:
                    self._stopped_until = now + min(self.unseen, self.budget)
        self._beat, self._cpu_beat = now, cpu

    def lag(self) -> float:
        """The loop's lag now: the last sample's, or longer when the sampler is overdue (a
        stall the checks queued behind it see before the sampler runs again)."""
        beat = self._beat
        if beat is None or not self._running():
            return 0.0
        return max(self.last, self._clock.monotonic() - beat - self.interval)

    def starved(self) -> bool:
        """The lag is past the threshold now, or a late sample was within as long as its lag."""
        return self.check(None, 0.0)[1]

    def left(self, remaining: float | None = None, waited: float = 0.0) -> float:
        """The time a check has left for its decision: the budget less ``waited`` (what the
        door saw it wait), and no more than the call's own time ``remaining`` (when the door
        knows it: gRPC's deadline) less Envoy's margin (:func:`margin`)."""
        left = self.budget - waited
        return left if remaining is None else min(left, remaining - margin(remaining))

    def check(self, remaining: float | None, waited: float, on_arrival: bool = True) -> tuple[float, bool]:
        """A check's (:meth:`left`, starved), with one clock read (the request path).

        ``on_arrival``: the deadline was stamped when the call arrived (grpc.aio's threads);
        False when it was stamped when the loop read the call (the gRPC port on the event
        loop, ``--grpc-server asyncio``): a stall of the loop alone then delayed the check
        unseen by its deadline, and the HTTP port's rule applies (the deadline still bounds
        ``left``).

        Starved: on the HTTP port (no deadline: every stall of the loop delayed the check
        unseen) while the loop's lag is past the threshold, or the check waited its whole
        budget; on the gRPC port only for a stall the process did not run through (stopped or
        its CPU taken), since gRPC's own threads stamp the call's deadline on arrival through
        a stall of the loop alone (a garbage collection, a long callback): the deadline has
        seen it and ``left`` tells it. A deadline shorter than the budget (a client's short
        timeout) never makes a check starved: it is decided within what it has."""
        left = self.budget - waited
        if remaining is not None:
            left = min(left, remaining - margin(remaining))
        starved = remaining is None and waited >= self.budget  # HTTP: a wait is Envoy's too
        beat = self._beat
        if not starved and beat is not None and self._running():
            now = self._clock.monotonic()
            over = now - beat - self.interval
            if remaining is None or not on_arrival:
                starved = over >= self.threshold or self.last >= self.threshold or now < self._starved_until
            else:
                if over >= self.threshold:  # overdue: the part of it the process ran through
                    over -= self._cpu() - self._cpu_beat
                starved = over >= self.threshold or self.unseen >= self.threshold or now < self._stopped_until
        if (remaining is not None and remaining + self.interval < self.budget and not starved
                and remaining + self.lag() < self.budget):  # not a wait behind a lagging loop
            self._short_log.log(logging.WARNING, "a Check call arrived with %.0f ms left of its "
                                "deadline, less than the check budget (%.0f ms): its client's timeout "
                                "is too short (Envoy's ext_authz timeout should be the budget plus "
                                "%.0f ms, as envoy-config renders it); such checks are decided within "
                                "what they have", remaining * 1000, self.budget * 1000, ENVOY_MARGIN_MS,
                                fields={"event": "short_check_timeout",
                                        "remaining_ms": round(remaining * 1000, 1),
                                        "check_budget_ms": self.budget * 1000})
        return left, starved

    def status(self) -> Mapping[str, Any]:
        return {"overload": {"loop_lag_seconds": round(self.lag(), 6), "peak_lag_seconds": round(self.peak, 6),
                             "starved": self.starved(), "threshold_seconds": self.threshold,
                             "check_budget_seconds": self.budget,
                             "checks": dict(sorted(self.overloaded.items()))}}
