"""Observability and safe rollout: metrics, traces, decision logs, the dark-launch record.

Everything here is an :class:`extauthz.engine.engine.Observer` (called once per decision on the
request path, so each one does only cheap, precomputed work) or a background job the server
runs. Nothing here imports grpc.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..core.context import RequestContext
from ..core.verdict import Decision
from ..policy.model import Policy
from .base import NullObserver, Observer

log = logging.getLogger("extauthz.observe")


class Observers:
    """Several observers as one. An observer that raises is logged once and counted; the
    request it was observing is decided all the same. Each member hears of each failure in
    ``decision.failures`` (``store_failed``)."""

    __slots__ = ("_decided", "_failed", "errors", "members")

    def __init__(self, members: Sequence[Observer]) -> None:
        self.members = tuple(members)
        self._decided = tuple(m.decided for m in self.members)
        self._failed = tuple(m.store_failed for m in self.members)
        self.errors = 0

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        for fn in self._decided:
            try:
                fn(ctx, decision, policy)
            except Exception:
                self._error()
        for reason in decision.failures:
            self.store_failed(reason)

    def store_failed(self, reason: str) -> None:
        for failed in self._failed:
            try:
                failed(reason)
            except Exception:
                self._error()

    def _error(self) -> None:
        self.errors += 1
        if self.errors == 1:
            log.exception("an observer failed (logged once; counted in /status)")


def compose(members: Sequence[Observer]) -> Observer:
    """No observer, or :class:`Observers` around the given ones."""
    if not members:
        return NullObserver()
    return Observers(members)
