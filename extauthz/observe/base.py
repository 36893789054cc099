"""The observer contract: what the engine calls once per decision. Metrics, decision
logs, the shadow recorder and tracing implement it (this package)."""

from __future__ import annotations

from typing import Protocol

from ..core.context import RequestContext
from ..core.verdict import Decision
from ..policy.model import Policy

__all__ = ["NullObserver", "Observer", "ObserverBase"]


class Observer(Protocol):
    """Called once per decision (``decision.failures`` names the failures met)."""

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None: ...

    def store_failed(self, reason: str) -> None:
        """Once per failure in ``decision.failures``, after :meth:`decided` (by
        :class:`~extauthz.observe.Observers`)."""


class ObserverBase:
    """What an observer that does not care about a call does: nothing."""

    __slots__ = ()

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        return None

    def store_failed(self, reason: str) -> None:
        return None


class NullObserver(ObserverBase):
    """No observer at all."""

    __slots__ = ()
