"""The store circuit breaker: skips the store while its calls fail at a high rate (the
engine then fails each limiter open or closed per ``failure_mode``)."""

from __future__ import annotations

from ..core.clock import Clock

__all__ = ["Breaker"]


class Breaker:
    """Circuit breaker on the store's failure *rate*.

    It opens when, over the last ``window`` (seconds), at least ``threshold`` calls failed and
    they were at least ``ratio`` of that window's calls; it then skips the store for
    ``open_for`` seconds, lets one probe through (half-open), and closes on its success.
    A dead or paused store fails every call and opens it within ``threshold`` calls (after
    an idle window), or once half the last window's calls failed; a saturated host where a
    few calls miss the deadline does not (a consecutive-failures breaker trips there on every
    burst of late answers, failing open for a whole second).

    The window slides: the counts of the window before weigh in by the share of it still
    inside the last ``window`` seconds. A fixed window judged the ratio on the few calls
    since it began: a burst of late answers right after it rolled over (the checks of one
    merged script call share its reply, so they are late together) was "every call failed"
    and opened the breaker under plain load (issue 29: 27,174 ``circuit_open`` fail-opens
    in 6 s with one hot key and 535 timeouts).
    """

    def __init__(self, clock: Clock, threshold: int = 10, ratio: float = 0.5, window: float = 1.0,
                 open_for: float = 1.0) -> None:
        self._clock = clock
        self.threshold = threshold
        self.ratio = ratio
        self.window = window
        self.open_for = open_for
        #: failures and calls in the current window
        self.failures = 0
        self.calls = 0
        #: the window before the current one (weighed by its share still in the last window)
        self._prev_failures = 0
        self._prev_calls = 0
        self._window_start = clock.monotonic()
        self.open_until: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        if self.open_until is None:
            return "closed"
        return "half_open" if self._clock.monotonic() >= self.open_until else "open"

    def like(self) -> Breaker:
        """A new closed breaker with this one's clock and settings (one per Cluster master)."""
        return Breaker(self._clock, self.threshold, self.ratio, self.window, self.open_for)

    def would_allow(self) -> bool:
        """What :meth:`allow` would answer, without taking the half-open probe."""
        return self.open_until is None or (not self._probing and self._clock.monotonic() >= self.open_until)

    def allow(self) -> bool:
        if self.open_until is None:
            return True
        if self._probing or self._clock.monotonic() < self.open_until:
            return False
        self._probing = True
        return True

    def abandon(self) -> None:
        """A call that :meth:`allow` let through was given up before its outcome (the check's
        time left ran out, or Envoy cancelled the Check): when it was the half-open probe, the
        next call probes instead (else the probe stays taken and every call is refused until
        a restart). No outcome is counted: the store was not the one late."""
        self._probing = False

    def _roll(self, now: float) -> None:
        elapsed = now - self._window_start
        if elapsed >= self.window:
            recent = elapsed < 2 * self.window  # the window that ends now is the one before
            self._prev_failures = self.failures if recent else 0
            self._prev_calls = self.calls if recent else 0
            # windows stay aligned (a multiple of ``window`` from the first), so the weight
            # of the one before is the share of it that the last ``window`` seconds cover
            self._window_start = now - (elapsed % self.window if recent else 0.0)
            self.failures, self.calls = 0, 0

    def _rate(self, now: float) -> tuple[float, float]:
        """Failures and calls over the last ``window`` seconds (sliding)."""
        weight = max(0.0, 1.0 - (now - self._window_start) / self.window)
        return (self.failures + weight * self._prev_failures, self.calls + weight * self._prev_calls)

    def success(self) -> None:
        if self.open_until is not None:  # the probe succeeded: close
            self.open_until, self._probing = None, False
            self.failures = self.calls = self._prev_failures = self._prev_calls = 0
            self._window_start = self._clock.monotonic()
            return
        self._roll(self._clock.monotonic())
        self.calls += 1

    def failure(self) -> None:
        now = self._clock.monotonic()
        if self.open_until is not None:  # the probe failed: stay open
            self.open_until, self._probing = now + self.open_for, False
            return
        self._roll(now)
        self.calls += 1
        self.failures += 1
        failures, calls = self._rate(now)
        if failures >= self.threshold and failures >= self.ratio * calls:
            self.open_until = now + self.open_for
