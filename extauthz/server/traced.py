"""The Check servicer inside a span: installed only when tracing is on."""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from ..engine import Engine
from ..observe.tracing import CHECK_SPAN, parent_context
from ..proto import auth_pb2
from ..tickets import LeaseTickets
from .services import AuthorizationService, LeaseIndex

_RPC = {"rpc.system": "grpc", "rpc.service": "envoy.service.auth.v3.Authorization", "rpc.method": "Check"}


class TracedAuthorizationService(AuthorizationService):
    """One ``extauthz.check`` span per Check, child of the ``traceparent`` in the call's
    metadata; the engine's observers add the decision to it."""

    def __init__(self, engine: Engine, tracer: Any, index: LeaseIndex | None = None,
                 tickets: LeaseTickets | None = None) -> None:
        super().__init__(engine, index, tickets)
        self._start = tracer.start_as_current_span

    async def Check(  # noqa: N802 - gRPC method name
        self, request: auth_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.CheckResponse:
        parent = parent_context(context.invocation_metadata())
        with self._start(CHECK_SPAN, context=parent, kind=SpanKind.SERVER, attributes=_RPC):
            return await super().Check(request, context)
