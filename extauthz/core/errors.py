"""The error hierarchy. Store errors are wrapped once, in the store, into these types."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class ExtauthzError(Exception):
    """Base class of every error this package raises on purpose."""


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'user-rate'?)`` for a mistyped name, or ``""`` when nothing is close
    (:func:`difflib.get_close_matches`)."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


@dataclass(frozen=True, slots=True)
class PolicyIssue:
    """One problem in a policy file: where it is and what is wrong."""

    file: str
    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.message}"


class PolicyError(ExtauthzError):
    """A policy could not be loaded. ``issues`` lists every problem found."""

    def __init__(self, issues: list[PolicyIssue]) -> None:
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


class StoreError(ExtauthzError):
    """The store could not answer. ``reason`` is a stable metrics label.

    ``late``: the call was sent but not answered in time, so its outcome is unknown; this
    future resolves to the answer if it comes after all (None: nothing can come).
    ``keys``: a key of each part that failed when only some did (Redis Cluster: their
    masters are the ones to blame); empty: the whole call."""

    reason = "error"
    late: asyncio.Future[Any] | None = None
    keys: tuple[str, ...] = ()


class StoreTimeout(StoreError):
    reason = "timeout"


class StoreUnavailable(StoreError):
    reason = "unavailable"


class CircuitOpen(StoreError):
    reason = "circuit_open"


class Overloaded(StoreError):
    """The check had no time left for its store call (the server is starved: its loop lags,
    or the check waited its budget away): its limiters fail per ``failure_mode``."""

    reason = "overload"


#: the failure reason of an unexpected exception (a bug) met while deciding
INTERNAL_ERROR = "internal_error"


class StoreInternalError(StoreError):
    """The store call raised something that is not a store error (a client library bug,
    e.g. a ``TypeError``): failed open or closed like any store failure."""

    reason = INTERNAL_ERROR
