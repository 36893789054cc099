"""The observer contract: what the engine calls once per decision. Metrics, decision
logs, the shadow recorder and tracing implement it (this package)."""

from __future__ import annotations

from typing import Protocol

from ..context import RequestContext
from ..policy.model import Policy
from ..verdict import Decision

__all__ = ["NullObserver", "Observer"]


class Observer(Protocol):
    """Called once per decision (``decision.failures`` names the failures met)."""

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None: ...


class NullObserver:
    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        return None
