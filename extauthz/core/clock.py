"""Clocks. Production uses the system clocks; tests inject :class:`ManualClock`."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, never going backwards."""

    def wall(self) -> float:
        """Seconds since the Unix epoch."""


class SystemClock:
    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to: timelines in tests without sleeps."""

    __slots__ = ("now",)

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self.now += seconds

    def set(self, now: float) -> None:
        self.now = now


SYSTEM_CLOCK = SystemClock()
