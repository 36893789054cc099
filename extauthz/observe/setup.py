"""The engine's observers and store-call wrapper, built once, before the engine (which
receives them at construction and is never rewired): metrics (when a metrics port is
asked for), the decision log, the shadow recorder, tracing (``OTEL_*`` unless given)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ..core.clock import Clock
from ..policy.model import Policy
from ..store.base import Store
from ..store.keys import Keys
from . import Observers
from .base import Observer
from .logs import DecisionLog
from .metrics import CheckFn, Metrics, instrument_store_check
from .recent_refusals import RecentRefusals
from .shadow import ShadowRecorder
from .tracing import Tracing, TracingObserver, provider_from_env

__all__ = ["Observability"]


class Observability:
    def __init__(self, *, store: Store, keys: Keys, clock: Clock, policy: Policy,
                 metrics: bool, decision_log_per_second: int = 1000,
                 tracer_provider: Any = None) -> None:
        provider = tracer_provider if tracer_provider is not None else provider_from_env()
        self.tracing = Tracing(provider) if provider is not None else None
        self.decision_log = DecisionLog(max_per_second=decision_log_per_second, clock=clock)
        self.shadow = ShadowRecorder(store, keys.shadow_log, clock=clock)
        self.metrics: Metrics | None = None
        observers: list[Observer] = []
        if metrics:
            self.metrics = Metrics()
            self.metrics.prime(policy)
            observers.append(self.metrics)
        #: each identity's last refusals on this replica (``extauthz inspect``)
        self.refusals = RecentRefusals(clock=clock)
        observers += [self.decision_log, self.shadow, self.refusals]
        if self.tracing is not None:
            observers.append(TracingObserver())
        #: the observers as one (``errors``: members that raised, on /status)
        self.observers = Observers(observers)
        #: the engine's observer
        self.observer: Observer = self.observers
        #: the engine's store call: latency histogram and/or a child span around ``store.check``
        self.store_check: CheckFn = instrument_store_check(
            store.check, histogram=self.metrics.store_call if self.metrics else None,
            tracer=self.tracing.tracer if self.tracing else None, store_name=store.name)

    def policy_changed(self, policy: Policy) -> None:
        if self.metrics is not None:
            self.metrics.prime(policy)

    async def housekeeping(self) -> None:
        """Once a second: decision-log summaries, shadow records to the store."""
        self.decision_log.flush()
        await self.shadow.flush()

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await self.shadow.flush()
        self.decision_log.flush()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)
            self.tracing = None
