"""Rate-limited log lines for errors that can repeat per request or per tick: the first
one is logged, then at most one line per ``interval`` saying how many were held back."""

from __future__ import annotations

import logging
from typing import Any

from .clock import SYSTEM_CLOCK, Clock

__all__ = ["LogThrottle"]


class LogThrottle:
    """One logger, one kind of event. :meth:`log` writes the record when the last written
    one is ``interval`` seconds old (with the count of records held back since), else only
    counts it; the caller's metrics count every event regardless."""

    def __init__(self, logger: logging.Logger, *, interval: float = 10.0,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._last: float | None = None
        self.suppressed = 0

    def log(self, level: int, msg: str, *args: Any, exc_info: Any = None,
            fields: dict[str, Any] | None = None) -> bool:
        """Log (True) or count as held back (False)."""
        now = self._clock.monotonic()
        if self._last is not None and now - self._last < self.interval:
            self.suppressed += 1
            return False
        held, self.suppressed, self._last = self.suppressed, 0, now
        if held:
            msg = f"{msg} (and {held} more like it in the last {self.interval:.0f} s)"
        self.logger.log(level, msg, *args, exc_info=exc_info,
                        extra={"fields": {**(fields or {}), "suppressed": held}})
        return True
