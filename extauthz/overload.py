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
  stall leaves drains in about as long as it lasted.
* **A check's time left** (:meth:`LoopLag.left`): the check budget (``serve
  --check-budget-ms``, 200 ms by default) less what the door saw the check wait: on the gRPC
  port the call's deadline (Envoy sends its timeout as ``grpc-timeout``; the budget plus
  :data:`~extauthz.settings.ENVOY_MARGIN_MS` as ``envoy-config`` renders it), on the HTTP port
  the time since the request's bytes arrived (queue time behind ``--http-max-active-checks``
  included; what the loop's lag delayed before it read them is not seen there).

The engine (:meth:`extauthz.engine.Engine.decide`) acts on both: while the server is starved
or a check has no time left, the shedders refuse non-critical tiers at once (never critical);
a store call never outlives the time left, and a check with none left (or whose store call
runs out of it) fails its per-customer limiters per ``failure_mode``, counted with the reason
``overload`` (``extauthz_fail_open_total{reason="overload"}``). docs/operations.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

from .clock import SYSTEM_CLOCK, Clock

__all__ = ["LAG_INTERVAL", "LoopLag"]

#: the lag sampler's period (s): a starved loop is seen within a few of them
LAG_INTERVAL: Final = 0.025


class LoopLag:
    """The event loop's lag and the overload state of one server process (module docstring).

    ``budget``: seconds a check may take from its arrival to its answer. ``running``: whether
    the sampler job runs (a stopped sampler, as in a graceful stop, reads as no lag)."""

    def __init__(self, budget: float, *, clock: Clock = SYSTEM_CLOCK, interval: float = LAG_INTERVAL,
                 running: Callable[[], bool] = lambda: True) -> None:
        self.budget = budget
        #: the lag from which the server counts as starved
        self.threshold = budget / 2
        self.interval = interval
        self._clock = clock
        self._running = running
        #: when the sampler last ran (None: not yet)
        self._beat: float | None = None
        #: the lag the sampler measured last, and the largest since the server started
        self.last = 0.0
        self.peak = 0.0
        #: until when a late sample keeps the server starved
        self._starved_until = -math.inf
        #: checks that found the server starved or out of time, by tier
        self.overloaded: dict[str, int] = {}

    def tick(self) -> None:
        """The sampler's tick (a Runner job every :attr:`interval`): the lag of this wake-up."""
        now = self._clock.monotonic()
        if self._beat is not None:
            self.last = max(0.0, now - self._beat - self.interval)
            self.peak = max(self.peak, self.last)
            if self.last >= self.threshold:
                self._starved_until = now + min(self.last, self.budget)
        self._beat = now

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

    def left(self, deadline: float | None = None, waited: float = 0.0) -> float:
        """The time a check has left for its decision: the budget less ``waited`` (what the
        door saw it wait), and no more than ``deadline`` (the call's own time left less
        Envoy's margin, when the door knows it)."""
        left = self.budget - waited
        return left if deadline is None else min(left, deadline)

    def check(self, deadline: float | None, waited: float) -> tuple[float, bool]:
        """A check's (:meth:`left`, :meth:`starved`), with one clock read (the request path)."""
        left = self.budget - waited
        if deadline is not None and deadline < left:
            left = deadline
        beat = self._beat
        if beat is None or not self._running():
            return left, False
        now = self._clock.monotonic()
        return left, (now - beat - self.interval >= self.threshold or self.last >= self.threshold
                      or now < self._starved_until)

    def status(self) -> Mapping[str, Any]:
        return {"overload": {"loop_lag_seconds": round(self.lag(), 6), "peak_lag_seconds": round(self.peak, 6),
                             "starved": self.starved(), "threshold_seconds": self.threshold,
                             "check_budget_seconds": self.budget,
                             "checks": dict(sorted(self.overloaded.items()))}}
