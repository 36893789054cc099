"""The check flow inside a span, installed only when tracing is on; check_flow picks the
server's (flow.py imports nothing of this module: no circle)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanKind

from ..engine.engine import Engine
from ..engine.overload import LoopLag
from ..observe.tracing import CHECK_SPAN, parent_context
from .flow import A, C, CheckFlow, Door, M
from .leases import Leases

if TYPE_CHECKING:
    from ..observe.metrics import CheckDurations


class TracedCheckFlow(CheckFlow):
    """One ``extauthz.check`` span per check, on either front door, child of the
    ``traceparent`` the request carries (the gRPC call's metadata, the HTTP request's
    headers); the engine's observers add the decision to it."""

    def __init__(self, engine: Engine, leases: Leases, tracer: Any, lag: LoopLag | None = None,
                 durations: CheckDurations | None = None) -> None:
        super().__init__(engine, leases, lag, durations)
        self._start = tracer.start_as_current_span

    async def check(self, door: Door[M, C, A], message: M, call: C) -> A:
        with self._start(CHECK_SPAN, context=parent_context(door.carrier(message, call)),
                         kind=SpanKind.SERVER, attributes=door.span):
            return await super().check(door, message, call)


def check_flow(engine: Engine, leases: Leases, tracer: Any = None,
               lag: LoopLag | None = None, durations: CheckDurations | None = None) -> CheckFlow:
    """The server's check flow: inside one span per check when ``tracer`` is given."""
    if tracer is None:
        return CheckFlow(engine, leases, lag, durations)
    return TracedCheckFlow(engine, leases, tracer, lag, durations)
